"""The state machine's window record on PyTorch: `keras.Variable`s read and written
in place, and PyTorch's primitives for `gradaccum.core.transitions`.

- Fields are the state's variables (`state.TorchState`), by name with the record's
  prefix; a write copies into the variable's tensor (no new parameter).
- The sums' add is in place (`add_`, with the factor folded in), skipped as a
  whole for a micro-batch the screen refused.
- Decisions are Python: the step runs eagerly (a `torch.compile`d step breaks its
  graph there), so a window's close runs only when it closes, and an error raises
  at once.
- The non-finite screen is one fused reduction over every gradient
  (`torch._foreach_norm`: a norm is finite only when every element is).

`Runner` gives a `steps` callable the update index as a Python int.
"""

from __future__ import annotations

import functools

import torch

from gradaccum import _keras_common as kc
from gradaccum.backend_interface import Record
from gradaccum.backends.torch.state import window_prefix
from gradaccum.core import messages, overwrite
from gradaccum.core.state import NOISE_PIECES as PIECES
from gradaccum.core.state import accumulator_name
from gradaccum.core.window import ScheduleRunner


def tensor(value):
    """`value` (a keras Variable, a tensor, a number) as a torch tensor."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "value"):
        value = value.value
        if isinstance(value, torch.Tensor):
            return value
    return torch.as_tensor(value)


def eager(fn=None, *, recursive: bool = True):
    """`fn` run outside `torch.compile`'s graphs where a compiled step calls it
    (`jit_compile=True`): the state machine's decisions are Python, and a traced step
    would break its graph at each (with a warning); the model's forward and backward
    passes are what compiles. `recursive=False`: only `fn`'s own frame is left out,
    what it calls is traced (the step's methods, which call the model). Called
    eagerly, `fn` itself runs (a disabled function costs a pass through dynamo's
    frame hook at every call)."""
    if fn is None:
        return functools.partial(eager, recursive=recursive)
    disabled = torch.compiler.disable(fn, recursive=recursive)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


@eager
def truth(value) -> bool:
    """A boolean tensor (or Python bool) as a Python bool."""
    if isinstance(value, bool):
        return value
    return bool(tensor(value))


def all_finite(gradients):
    """Whether every element of every gradient is finite.

    One fused reduction decides in the usual case (an inf or a nan makes the L1 norms'
    sum non-finite). A sum that is not finite may also come from finite gradients
    whose float32 norms overflow: only then does an element-wise check decide, so the
    screen reports no false positive.
    """
    present = [g.detach() for g in gradients if g is not None]
    if not present:
        return torch.tensor(True)
    norms = torch._foreach_norm([g.float() for g in present], ord=1)
    if bool(torch.isfinite(torch.stack(norms).sum())):
        return torch.tensor(True)
    return torch.tensor(all(bool(torch.isfinite(g).all()) for g in present))


def squared_norm(gradients):
    """The squared norm of all of `gradients` together (float32): one fused
    multi-tensor reduction."""
    present = [g.detach().float() for g in gradients if g is not None]
    if not present:
        return torch.tensor(0.0)
    return torch.stack(torch._foreach_norm(present, ord=2)).square().sum()


def finite_and_norm(gradients):
    """`(all_finite, squared_norm)` from one reduction: the squared norm decides the
    screen as `all_finite`'s L1 norms do (not finite: an inf or a nan, or norms of
    finite values that overflowed, which the element-wise check tells apart)."""
    squared = squared_norm(gradients)
    if bool(torch.isfinite(squared)):
        return torch.tensor(True), squared
    present = [g.detach() for g in gradients if g is not None]
    return torch.tensor(all(bool(torch.isfinite(g).all()) for g in present)), squared


class FieldRecord(Record):
    """A record whose fields are a `TorchState`'s variables (`prefix` + name).

    Args:
        state: the `TorchState`.
        prefix: the record's prefix (`window_prefix`; "" for the fit record).
    """

    def __init__(self, state, prefix: str = ""):
        self.state = state
        self.prefix = prefix
        self.variables = state.variables

    def _variable(self, name: str):
        return self.variables[self.prefix + name]

    def has(self, name: str) -> bool:
        return (self.prefix + name) in self.variables

    def get(self, name: str):
        # A copy: the transitions may hold a field's value across a write to it.
        return self.variables[self.prefix + name].value.clone()

    # (The fields never require grad: written in place without `no_grad`.)

    def set(self, name: str, value) -> None:
        value = tensor(value)
        if value.requires_grad:
            value = value.detach()
        # `copy_` casts and broadcasts a scalar into the field.
        self.variables[self.prefix + name].value.copy_(value)

    def add(self, name: str, delta) -> None:
        target = self.variables[self.prefix + name].value
        if isinstance(delta, (int, float)):
            target.add_(delta)
        else:
            target.add_(tensor(delta).to(target.dtype))

    def cond(self, pred, true_fn, false_fn):
        return true_fn() if truth(pred) else false_fn()

    def fail(self, error, code: str, at, value=None) -> None:
        """Raises at once (the step runs eagerly): a non-finite gradient as a
        `FloatingPointError`, a weight or schedule as a `ValueError`."""
        if not truth(error):
            return
        micro_batch = int(self.state.variables[self.prefix + "micro_batches"].value) + 1
        message = messages.error_message(code, micro_batch, int(tensor(at)),
                                   None if value is None else int(tensor(value)))
        raise (FloatingPointError if code == "nonfinite" else ValueError)(message)


class WindowRecord(FieldRecord):
    """One optimizer's window over its share of the state's sums.

    Args:
        state: the `TorchState`.
        index: the record's number (`window_prefix`).
        optimizer: the optimizer that applies the window (None: accumulate only).
        variables: the variables it updates, in order.
        slots: where their sums sit among the state's accumulators.
        noise: with privacy, `sums -> noised sums` for the window's update.
        reduce: under `torch.distributed`, `(sums, weight) -> (sums, weight)` summed
            over the processes (one all-reduce); None on one process.
    """

    def __init__(self, state, index, optimizer, variables, slots, noise=None, reduce=None,
                 scaling=None, sharded=None):
        super().__init__(state, window_prefix(index))
        self.optimizer = optimizer
        # The LossScaleOptimizer whose scale the gradients carry (the applying one
        # where it is one).
        self.scaling = (scaling if scaling is not None
                        else optimizer if kc.is_loss_scale_optimizer(optimizer) else None)
        self.targets = list(variables)
        self.slots = list(slots)
        self.overwrites, self.measured = overwrite.kinds(self.targets)
        self.noise = noise
        self.reduce = reduce
        # `sums="sharded"`: the sums as this process's shard (`ShardedSums`).
        self.sharded = sharded
        self.outcome = None
        self._global = None
        # Where the per-variable fields (`received`) hold this record's variables:
        # None where they are all of them, in order.
        size = (int(self.variables[self.prefix + "received"].shape[0])
                if self.has("received") else len(self.slots))
        self._share = (None if self.slots == list(range(size))
                       else torch.as_tensor(self.slots, dtype=torch.long))

    # The sums -----------------------------------------------------------------------

    def _sums(self):
        return [self.variables[accumulator_name(i)].value for i in self.slots]

    def sums(self) -> list:
        if self._global is not None:
            return self._global[0]
        if self.sharded is not None:
            # The shards gathered: every process must ask together.
            return self.sharded.gather(self.state.accumulators[0].value)
        return self._sums()

    def dtypes(self) -> list:
        return [v.dtype for v in self.targets]

    def add_sums(self, gradients, factor, accept) -> None:
        if self.sharded is not None:
            # Every process takes part in the reduce-scatter, accepted or not.
            with torch.no_grad():
                self.sharded.add(self.state.accumulators[0].value, gradients,
                                 None if factor is None else tensor(factor),
                                 truth(accept))
            return
        if not truth(accept):
            return
        with torch.no_grad():
            for total, gradient in zip(self._sums(), gradients):
                if gradient is None:
                    continue
                gradient = tensor(gradient).detach().to(total.dtype)
                if factor is None:
                    total.add_(gradient)
                else:
                    total.add_(gradient, alpha=float(tensor(factor)))

    def set_sums(self, values) -> None:
        with torch.no_grad():
            for total, value in zip(self._sums(), values):
                if value is not None:
                    total.copy_(tensor(value).detach().to(total.dtype))

    def empty_sums(self) -> None:
        with torch.no_grad():
            for total in (self._sums() if self.sharded is None
                          else [self.state.accumulators[0].value]):
                total.zero_()

    def window_weight(self):
        weight = self.get("total_weight")
        if self.reduce is not None:
            weight = self.reduce.scalar(weight)
        return weight

    def get(self, name: str):
        if self._global is not None and name in self._global[1]:
            value = self._global[1][name]
        else:
            value = super().get(name)
        if name == "received" and self._share is not None:
            value = value[self._share]
        return value

    def set(self, name: str, value) -> None:
        if name == "received" and self._share is not None:
            # The record's share of the per-variable counts (its variables' slots;
            # a model's own step's optimizers each update a part of the model).
            target = self._variable(name).value
            with torch.no_grad():
                target[self._share] = tensor(value).to(device=target.device,
                                                       dtype=target.dtype)
            return
        super().set(name, value)

    # The close ----------------------------------------------------------------------

    def close(self, apply, close, update, finish, empty_sums=True):
        if not truth(close):
            return torch.tensor(False)
        if self.sharded is not None:
            # The processes' sums already, in shards: gathered (one all-gather),
            # and the window's weight and received counts summed (one all-reduce).
            sums = self.sharded.gather(self.state.accumulators[0].value)
            fields = self.reduce.fields({name: super(WindowRecord, self).get(name)
                                         for name in self._reduced_fields()})
            self._global = (sums, fields)
        elif self.reduce is not None:
            # One all-reduce: the window's sums, weight and received counts of every
            # process; while the window closes they are the global window's.
            sums, fields = self.reduce.window(
                self._sums(), {name: super(WindowRecord, self).get(name)
                               for name in self._reduced_fields()})
            if any(self.overwrites):
                sums = self.reduce.maxima(sums, self._sums(), self.overwrites)
            self._global = (sums, fields)
        try:
            applied = truth(apply) and truth(self.holds())
            if applied:
                update()
            finish(torch.tensor(applied))
        finally:
            self._global = None
        if empty_sums:
            self.empty_sums()
        return torch.tensor(applied)

    def _reduced_fields(self) -> tuple:
        """The fields the processes' window sums at its close: its weight, the
        received counts and (with the noise scale) its pieces."""
        return ("total_weight", "received") + tuple(
            name for name in PIECES if self.has(name))

    def holds(self):
        if self._global is not None:
            return self._global[1]["total_weight"] > 0
        return super().holds()

    def apply(self, gradients) -> None:
        """One optimizer update with G; a variable the window gave no gradient is
        left out, as Keras leaves out a `None` gradient."""
        optimizer = self.optimizer
        if kc.is_loss_scale_optimizer(optimizer):
            # The accumulated gradients are unscaled and finite already.
            optimizer = optimizer.inner_optimizer
        received = self.get("received") if self.has("received") else None
        pairs = []
        for i, (gradient, variable) in enumerate(zip(gradients, self.targets)):
            if gradient is None or (received is not None and not received[i] > 0):
                continue
            pairs.append((gradient, variable))
        if not pairs:
            return
        with torch.no_grad():
            # The class's own `apply`: a model's own step routes the instance's
            # through its window (`own_step.ApplyRouter`).
            type(optimizer).apply(optimizer, [g for g, _ in pairs], [v for _, v in pairs])

    def all_finite(self, gradients):
        if not self.has("noise_pieces_norm"):
            return all_finite(gradients)
        # With the noise scale, its squared norm is the screen's reduction too.
        verdict, squared = finite_and_norm(gradients)
        self.screened(gradients, squared)
        return verdict

    def norm_of(self, gradients):
        return squared_norm(gradients)

    def noised(self, sums) -> list:
        return sums if self.noise is None else self.noise(self, sums)

    def loss_scale(self):
        optimizer = self.scaling
        if optimizer is None:
            return None
        return (tensor(optimizer.step_counter).detach().clone(),
                tensor(optimizer.dynamic_scale).detach().clone())

    def set_loss_scale(self, counter, scale) -> None:
        optimizer = self.scaling
        optimizer.step_counter.assign(counter)
        optimizer.dynamic_scale.assign(scale)


@eager
def snapshot(variables) -> list:
    """The variables' values, copied (a step's metrics, or the forward state a
    skipped micro-batch puts back)."""
    return [v.value.detach().clone() for v in variables]


@eager
def restore(variables, values) -> None:
    """Puts back what `snapshot` copied."""
    with torch.no_grad():
        for variable, value in zip(variables, values):
            variable.value.copy_(value)


class Runner(ScheduleRunner):
    """How the eager step runs a `steps` callable: on the update index as a Python
    int (so it may use a Python `if`)."""

    def value(self, prepared, update_index):
        return prepared(int(tensor(update_index)))
