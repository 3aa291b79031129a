"""`GradientAccumulator` on PyTorch: accumulation for a custom training loop in
keras.io's "training loop from scratch in PyTorch" pattern, and under
`torch.distributed` with one all-reduce per update.

The state is `keras.Variable`s (torch tensors, `state.TorchState`); what a
micro-batch does to the window is `gradaccum.core.transitions`, the state machine
`fit` runs on every backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import keras
import torch

from gradaccum import _keras_common as kc
from gradaccum.backends.torch.distributed import Reducer, ShardedSums, default_group
from gradaccum.backends.torch.record import Runner, WindowRecord, tensor, truth
from gradaccum.backends.torch.state import TorchState
from gradaccum.core import overwrite
from gradaccum.core import transitions as tr
from gradaccum.core.accumulator import StatefulAccumulator
from gradaccum.core.combine import REDUCTIONS, combine
from gradaccum.core.hints import DType, Nonfinite, Real, Steps
from gradaccum.core.noise_scale import accumulator_noise
from gradaccum.core.policy import Policy
from gradaccum.core.screening import warn_skipped
from gradaccum.core.validation import (
    accumulator_dtype_name,
    check_choice,
    check_loss_scale_optimizer,
    check_noise_scale,
    check_nonfinite,
    check_optimizer,
    check_variables,
    check_weight_value,
    variable_name,
)
from gradaccum.core.window import WindowRule

__all__ = ["GradientAccumulator"]


class GradientAccumulator(StatefulAccumulator):
    r"""Accumulates micro-batch gradients in a PyTorch training loop and applies their
    combination.

    A window of micro-batches with gradients $g_i$ and weights $w_i$ becomes one
    update with the gradient $G = \sum_i w_i g_i / \sum_i w_i$ (reduction
    `"mean"`): the gradient of the whole window taken as one batch, when $w_i$ is
    the micro-batch's loss normalizer (its number of samples for a per-sample mean
    loss, its number of tokens for a per-token mean).

    Pass it the parameters' `.grad` after `loss.backward()`: `[v.value.grad for v in
    model.trainable_weights]`. A `None` gradient leaves its sum as it is; a variable
    with none in the whole window is left out of the update.

    Under `torch.distributed` (initialized with several processes), each process
    accumulates its own micro-batches and a closing window makes one all-reduce of
    its sums and weights: every process applies the update of one process training
    on the global window. Run each micro-batch's forward and backward pass inside
    `acc.no_sync(ddp_model)` so that `DistributedDataParallel` communicates nothing
    itself: one all-reduce per update in all (`all_reduces` counts gradaccum's).

    Mixed precision: with a `keras.optimizers.LossScaleOptimizer`, pass gradients of
    `optimizer.scale_loss(loss)`; each micro-batch is unscaled into the float32
    sums, an overflowing one is skipped and the scale backs off.

    Args:
        variables: the trainable variables whose gradients are accumulated, in the
            order of the gradient lists passed to `step` and `accumulate`.
        steps: micro-batches per window, used by `step`: an integer >= 1, sorted
            `(from_update, k)` pairs starting at 0, or a callable
            `update_index -> int` (a Python int). A window's length is read when it
            opens. None when the caller decides when to `apply`.
        weight_per_update: instead of `steps`, a weight budget: `step` closes the
            window at the first micro-batch after which its total weight (the
            global window's under torch.distributed) reaches it.
        reduction: `"mean"` (default) or `"sum"` ($G = \sum_i g_i$, weights ignored).
        accumulator_dtype: the sums' dtype, float32 by default whatever the
            gradients' (bfloat16 gradients lose nothing).
        nonfinite: a micro-batch whose gradient holds an inf or a nan is `"skip"`ped
            (default: dropped with its weight, counted in `skipped`, warned once),
            `"apply"`ed as it is, or `"raise"`s a `FloatingPointError`; or a
            callable `gradients -> bool` (True skips the micro-batch).
        process_group: the `torch.distributed` group a window is summed over:
            `"auto"` (default) is the default group where torch.distributed is
            initialized with several processes; None keeps each process's window
            its own.
        sums: where the sums sit across the group's W processes: `"local"`
            (default): each process keeps whole sums of its own micro-batches,
            summed over the processes once per update (one all-reduce).
            `"sharded"`: each process keeps 1/W of them (float32: 4 bytes per
            parameter over W), every micro-batch's gradients reduce-scattered into
            them (one `reduce_scatter` per micro-batch, every process taking part)
            and gathered when the window closes (one all-gather). `state_dict` then
            holds this process's shard (`accumulator_shard`), restored by a job of
            as many processes. One process: the two are the same.
        noise_scale: `True`: the accumulator estimates the gradient noise scale
            from each window it applies (its micro-batches' gradients against the
            window's; each process's share is a piece), read by its `noise_scale`
            property (`reset_noise_scale` starts a new reading), in the unit of the
            weights given.
        name: the name scope of the state's variables.

    Raises:
        ValueError: an empty variable list, invalid `steps`, `weight_per_update`
            <= 0 or with `steps`, an unknown `reduction` or `nonfinite`, a
            non-floating `accumulator_dtype`.

    Examples:

        >>> import os; os.environ["KERAS_BACKEND"] = "torch"
        >>> import keras, torch, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> optimizer = keras.optimizers.SGD(0.1)
        >>> acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2)
        >>> x, y = torch.ones((12, 3)), torch.zeros((12, 1))
        >>> for start in (0, 4, 8):  # micro-batches of 4, 4 and 4
        ...     loss = keras.ops.mean((model(x[start:start + 4]) - y[start:start + 4]) ** 2)
        ...     model.zero_grad()
        ...     loss.backward()
        ...     grads = [v.value.grad for v in model.trainable_weights]
        ...     applied = acc.step(optimizer, grads, weight=4)
        >>> bool(acc.apply(optimizer))  # the partial window of 1 at the end of the data
        True
        >>> int(acc.updates.numpy()), int(acc.micro_step.numpy())
        (2, 0)
    """

    def __init__(self, variables: Sequence[Any], *, steps: Steps | None = None,
                 weight_per_update: Real | None = None, reduction: str = "mean",
                 accumulator_dtype: DType = "float32", nonfinite: Nonfinite = "skip",
                 process_group: Any = "auto", sums: str = "local",
                 noise_scale: bool = False, name: str = "gradient_accumulator") -> None:
        variables = check_variables(variables)
        self.sums = check_choice("sums", sums, ("local", "sharded"))
        self._rule = WindowRule(steps, weight_per_update, Runner())
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)
        self.accumulator_dtype = accumulator_dtype_name(accumulator_dtype)
        self.nonfinite = check_nonfinite(nonfinite)
        self.policy = Policy(self._rule, self.reduction, self.nonfinite)
        self.target_variables = tuple(variables)
        group = default_group(process_group)
        self._reducer = Reducer(group) if group is not None else None
        # sums="sharded" over several processes: this process keeps 1/W of the sums.
        self._sharded = None
        if sums == "sharded" and self._reducer is not None:
            if any(overwrite.kinds(variables)[0]):
                raise ValueError(
                    '`sums="sharded"` needs every variable\'s gradient summed; a '
                    "variable marked `overwrite_with_gradient` (float8) keeps the "
                    'processes\' maximum instead. Received: sums="sharded"; pass '
                    'sums="local".'
                )
            self._sharded = ShardedSums(self._reducer, [tuple(v.shape) for v in variables])
        self.state = TorchState(
            variables, self.accumulator_dtype, fit=False, name=name,
            shard_size=None if self._sharded is None else self._sharded.shard_size,
            noise=check_noise_scale(accumulator_noise(noise_scale, self._rule),
                                    self.reduction))
        self._warned_skip = False
        self._scaling = None

    # Read-only views ----------------------------------------------------------------

    @property
    def all_reduces(self) -> int:
        """All-reduces this accumulator made under torch.distributed (one per
        update; with a weight budget, one more per micro-batch)."""
        return 0 if self._reducer is None else self._reducer.all_reduces

    @property
    def reduce_scatters(self) -> int:
        """Reduce-scatters made with `sums="sharded"` (one per micro-batch)."""
        return 0 if self._reducer is None else self._reducer.reduce_scatters

    @property
    def all_gathers(self) -> int:
        """All-gathers made with `sums="sharded"` (one per update, and one per
        `gradients()` call, which every process makes together)."""
        return 0 if self._reducer is None else self._reducer.all_gathers

    @property
    def accumulators(self) -> list:
        return list(self.state.accumulators)

    def _field(self, name: str) -> Any:
        """The state's field `name` as a variable."""
        return self.state.variables[name]

    def __getattr__(self, name: str) -> Any:
        # The record's other fields as variables (`received`, `window_skipped`...).
        state = self.__dict__.get("state")
        if state is not None and name in state.variables:
            return state.variables[name]
        raise AttributeError(f"'GradientAccumulator' object has no attribute {name!r}")

    def state_variables(self) -> dict:
        """Every variable of the state under its stable name."""
        return self.state.named()

    def state_dict(self) -> dict:
        """The state as tensors by name, for `torch.save` beside the model's and the
        optimizer's (a run restored in the middle of a window goes on exactly)."""
        return {name: v.value.detach().clone() for name, v in self.state.variables.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores what `state_dict` returned (names and shapes must match)."""
        variables = self.state.variables
        missing = sorted(set(variables) - set(state_dict))
        unknown = sorted(set(state_dict) - set(variables))
        if missing or unknown:
            raise ValueError(
                "`state_dict` must hold this accumulator's state. Received: a state "
                f"missing {missing} and with unknown entries {unknown}."
            )
        for name, variable in variables.items():
            value = torch.as_tensor(state_dict[name])
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"`state_dict` must hold entries of this accumulator's shapes. "
                    f"Received: {name!r} of shape {tuple(value.shape)} for "
                    f"{tuple(variable.shape)}."
                )
            with torch.no_grad():
                variable.value.copy_(value.to(variable.value.device, variable.value.dtype))

    def window_length(self) -> Any:
        """Micro-batches in the open window, skipped ones included."""
        return tr.window_length(self._record())

    def window_due(self) -> Any:
        """Whether the open window is due (a boolean tensor)."""
        return tr.due(self.policy, self._record())

    @contextlib.contextmanager
    def no_sync(self, module: Any) -> Iterator[None]:
        """The context to run a micro-batch's forward and backward passes in:
        `module.no_sync()` for a `DistributedDataParallel` module (gradaccum makes the
        window's one all-reduce itself), nothing otherwise."""
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            with module.no_sync():
                yield
        else:
            yield

    # Accumulation ---------------------------------------------------------------------

    def _record(self, optimizer: Any = None, scaling: Any = None) -> WindowRecord:
        return WindowRecord(self.state, 0, optimizer, self.target_variables,
                            range(len(self.target_variables)), reduce=self._reducer,
                            scaling=scaling, sharded=self._sharded)

    def accumulate(
        self,
        gradients: Sequence[Any],
        weight: Any = 1.0,
        *,
        loss_scale_optimizer: keras.optimizers.LossScaleOptimizer | None = None,
    ) -> Any:
        """Adds one micro-batch's gradients with its weight `w_i` (a scalar >= 0).
        `loss_scale_optimizer`: the LossScaleOptimizer whose `scale_loss` scaled the
        loss (the gradients are unscaled; a non-finite one is skipped). Returns
        whether the micro-batch was accumulated (a boolean tensor)."""
        return self._run(gradients, weight, weighted=False,
                         loss_scale_optimizer=loss_scale_optimizer)

    def accumulate_weighted(
        self,
        weighted_gradients: Sequence[Any],
        weight: Any,
        *,
        loss_scale_optimizer: keras.optimizers.LossScaleOptimizer | None = None,
    ) -> Any:
        """Adds gradients that carry their weight already (of `weight * loss`),
        with `weight` to the total."""
        return self._run(weighted_gradients, weight, weighted=True,
                         loss_scale_optimizer=loss_scale_optimizer)

    def step(self, optimizer: keras.optimizers.Optimizer, gradients: Sequence[Any],
             weight: Any = 1.0) -> torch.Tensor:
        """Accumulates a micro-batch and applies when the window is due. Returns
        whether this call made an update (a boolean tensor)."""
        if self.steps is None and self.weight_per_update is None:
            raise ValueError(
                "`steps` or `weight_per_update` must be given to use `step()`. "
                "Received: steps=None, weight_per_update=None. Pass one of them to "
                "GradientAccumulator, or call `accumulate()` and `apply()` yourself."
            )
        check_optimizer(optimizer)
        self._prepare(optimizer)
        scaled = optimizer if kc.is_loss_scale_optimizer(optimizer) else None
        record = self._record(optimizer)
        self._run(gradients, weight, weighted=False, loss_scale_optimizer=scaled,
                  record=record, closes=True)
        assert record.outcome is not None  # set by the micro-batch's transition
        return torch.as_tensor(truth(record.outcome.applied))

    def _run(self, gradients: Sequence[Any], weight: Any, *, weighted: bool,
             loss_scale_optimizer: Any = None, record: WindowRecord | None = None,
             closes: bool = False) -> Any:
        gradients = self._checked(gradients)
        weight = self._weight(weight)
        growth = None
        if loss_scale_optimizer is not None:
            check_loss_scale_optimizer(loss_scale_optimizer)
            if self._reducer is not None:
                raise ValueError(
                    "A GradientAccumulator summed over torch.distributed processes "
                    "needs an optimizer without loss scaling (each process's scale "
                    "would react to its own micro-batches). Received: a "
                    "LossScaleOptimizer; use bfloat16 (mixed_bfloat16) or float32."
                )
            self._scaling = loss_scale_optimizer
            self._prepare(loss_scale_optimizer)
            growth = int(loss_scale_optimizer.dynamic_growth_steps)
        if record is None:
            record = self._record(scaling=loss_scale_optimizer)
        with torch.no_grad():
            accepted = tr.micro_batch(self.policy, record, gradients, weight,
                                      weighted=weighted, loss_scale=growth, closes=closes)
        if self.nonfinite == "skip" and loss_scale_optimizer is None and not truth(accepted):
            if not self._warned_skip:
                self._warned_skip = True
                warn_skipped(1, stacklevel=4)
        return accepted

    def _checked(self, gradients: Sequence[Any]) -> list:
        gradients = list(gradients)
        targets = self.target_variables
        if len(gradients) != len(targets):
            raise ValueError(
                f"`gradients` must have one entry per variable ({len(targets)}). "
                f"Received: {len(gradients)} gradients."
            )
        for g, v in zip(gradients, targets):
            if g is not None and tuple(g.shape) != tuple(v.shape):
                raise ValueError(
                    f"The gradient of variable '{variable_name(v)}' must have shape "
                    f"{tuple(v.shape)}. Received: shape={tuple(g.shape)}"
                )
        return [None if g is None else tensor(g) for g in gradients]

    def _weight(self, weight: Any) -> torch.Tensor:
        try:
            value = tensor(weight).detach()
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"`weight` must be a finite number >= 0. Received: weight={weight!r}"
            ) from None
        check_weight_value(value.cpu().numpy())
        return value.reshape(()).float()

    def _prepare(self, optimizer: Any) -> None:
        check_optimizer(optimizer)
        if not optimizer.built:
            optimizer.build(list(self.target_variables))

    # The window's combination -------------------------------------------------------

    def gradients(self) -> list:
        """The open window's combined gradient, without resetting (`None` for a
        variable that received no gradient in the window): this process's window,
        or with `sums="sharded"` the processes' window (then every process must call
        it: it gathers the shards)."""
        record = self._record()
        weight, received = record.get("total_weight"), record.get("received")
        if self._sharded is not None:
            # The shards gathered with the processes' weights and received counts
            # (every process must call it: two collectives).
            assert self._reducer is not None, "sharded sums have a group"
            fields = self._reducer.fields({"total_weight": weight, "received": received})
            weight, received = fields["total_weight"], fields["received"]
        combined = combine(record.sums(), weight, self.reduction, record.dtypes())
        # Copies: under reduction "sum" the combination is the sums themselves,
        # which the next `accumulate` or `reset` changes in place.
        return [g.clone() if r > 0 else None for g, r in zip(combined, received)]

    def reset(self) -> None:
        """Empties the open window."""
        tr.reset(self._record())

    def apply(self, optimizer: keras.optimizers.Optimizer) -> Any:
        """Applies the open window (full or partial, normalized by its own weights)
        and empties it; nothing with an empty window. Returns whether an update
        happened (a boolean tensor)."""
        return self.apply_if(optimizer, True)

    def apply_if(self, optimizer: keras.optimizers.Optimizer, condition: Any) -> Any:
        """Applies and empties the window when `condition` holds (the same on every
        process under torch.distributed) and it holds a micro-batch."""
        self._prepare(optimizer)
        with torch.no_grad():
            return tr.apply_now(self.policy, self._record(optimizer, self._scaling),
                                torch.as_tensor(truth(condition)))

    def drop(self) -> Any:
        """Discards the open window if it holds a micro-batch; returns whether it
        did."""
        return tr.drop(self._record())
