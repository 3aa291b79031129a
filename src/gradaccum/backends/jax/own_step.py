"""What a model's own JAX `train_step(state, data)` hands to its optimizers.

While the step runs, every optimizer the model holds (`self.optimizer`, a GAN's
`self.g_optimizer` / `self.d_optimizer`, one in a list or dict attribute) has its
`stateless_apply` replaced by a
recorder (`Handover`): it keeps the gradients, the trainable variables and the
optimizer variables handed to it, and gives the variables back unchanged. `shares`
then finds each handed array in the state the trainer carries (by identity: the
step slices the state it received), so that the window's update can be made when it
closes: one `stateless_apply` per optimizer (`Applier`), on its variables only.

Keras's JAX trainer carries `self.optimizer`'s variables; a model with several
optimizers carries theirs in that place of the state (its `_get_jax_state` and
`jax_state_sync` put them there), and hands each optimizer its slice of it.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax

from gradaccum import _keras_common as kc
from gradaccum._validation import check_optimizer


class Applier(NamedTuple):
    """One optimizer's share of the state: where its variables sit among the
    state's optimizer variables (in `optimizer.variables`' order), which trainable
    variables it updates, and which of those it receives no gradient for (`None`
    in the step, skipped by Keras's optimizers as they are)."""

    optimizer: object
    optimizer_slots: tuple
    variable_slots: tuple
    no_gradient: frozenset = frozenset()

    @classmethod
    def whole(cls, optimizer, n_variables: int) -> Applier:
        """Keras's default step: the model's optimizer on all the state."""
        return cls(optimizer, tuple(range(len(optimizer.variables))),
                   tuple(range(n_variables)))

    def iterations_slot(self) -> int:
        """Where the optimizer's update counter sits in the state."""
        optimizer = self.optimizer
        index = next(i for i, v in enumerate(optimizer.variables) if v is optimizer.iterations)
        return self.optimizer_slots[index]

    def renumbered(self, start: int) -> Applier:
        """The same share with its optimizer variables at `start`, `start + 1`, ...
        (a state made of each optimizer's own variables in turn)."""
        count = len(self.optimizer_slots)
        return self._replace(optimizer_slots=tuple(range(start, start + count)))


class Handed(NamedTuple):
    """One `stateless_apply` call of the step: the optimizer, the name the model
    reaches it by, and what the step handed it."""

    optimizer: object
    name: str
    optimizer_variables: list
    gradients: list
    trainable_variables: list


class Handover:
    """Records what the model's own step hands to each optimizer's
    `stateless_apply` (at most once per optimizer and step).

    Args:
        model: the model whose step runs.
    """

    def __init__(self, model):
        self.model = model
        self.handed = []

    def recorder(self, name, optimizer):
        def stateless_apply(optimizer_variables, grads, trainable_variables):
            if any(entry.optimizer is optimizer for entry in self.handed):
                raise ValueError(
                    "On Keras's JAX backend a model's own `train_step` must hand its "
                    f"gradients to `self.{name}.stateless_apply` once per step for "
                    "gradaccum to accumulate them. Received: a second call in one step "
                    f"of {type(self.model).__name__}.train_step."
                )
            returned = list(trainable_variables)
            self.handed.append(Handed(optimizer, name, list(optimizer_variables),
                                      list(grads), returned))
            return returned, list(optimizer_variables)

        return stateless_apply

    @contextlib.contextmanager
    def recording(self, hidden):
        """While the step runs: each optimizer's `stateless_apply` records, and the
        metric `hidden` (gradaccum's state) is not among the model's metrics (the
        step updates those it finds)."""
        routed = kc.named_optimizers(self.model)
        metrics = kc.model_metrics(self.model)
        kept = list(metrics)
        metrics[:] = [m for m in metrics if m is not hidden]
        for name, optimizer in routed:
            optimizer.stateless_apply = self.recorder(name, optimizer)
        try:
            yield self
        finally:
            for _, optimizer in routed:
                del optimizer.stateless_apply
            metrics[:] = kept


def shares(handed, trainable, optimizer_variables, step_name):
    """Each optimizer's `Applier` and the micro-batch's gradient per trainable
    variable of the state (None where no optimizer received one), from what the
    step `step_name` handed over (`Handover.handed`) and the state it received."""
    position = {id(t): i for i, t in enumerate(trainable)}
    slot = {id(v): i for i, v in enumerate(optimizer_variables)}
    gradients = [None] * len(trainable)
    owner = {}
    appliers = []
    for optimizer, name, handed_optimizer, grads, variables in handed:
        check_optimizer(optimizer)
        if len(grads) != len(variables):
            raise ValueError(
                f"The gradients a model's own `train_step` hands to `self.{name}."
                "stateless_apply` must be one per trainable variable handed with them. "
                f"Received: {len(grads)} gradients for {len(variables)} variables in "
                f"{step_name}."
            )
        slots = [slot.get(id(v)) for v in handed_optimizer]
        if len(slots) != len(optimizer.variables) or None in slots:
            raise ValueError(
                "On Keras's JAX backend gradaccum applies each optimizer from the state "
                "the trainer carries: a model's own `train_step` must hand "
                f"`self.{name}.stateless_apply` its optimizer's variables from the "
                "step's `state` (Keras carries `self.optimizer`'s; a model with "
                "several optimizers carries theirs in that place, from its "
                "`_get_jax_state`). Received: optimizer variables that are not the "
                f"state's in {step_name}."
            )
        places = [position.get(id(v)) for v in variables]
        if None in places:
            raise ValueError(
                "A model's own `train_step` must hand "
                f"`self.{name}.stateless_apply` the trainable variables of the step's "
                "`state` as it received them, for gradaccum to update them when a "
                f"window closes. Received: a value computed from them in {step_name}."
            )
        for place, grad in zip(places, grads):
            if place in owner:
                raise ValueError(
                    "Each trainable variable of a model's own `train_step` must be "
                    "handed to one optimizer. Received: variable "
                    f"{place} of the state handed to `self.{owner[place]}` and "
                    f"`self.{name}` in {step_name}."
                )
            owner[place] = name
            gradients[place] = grad
        no_gradient = frozenset(p for p, g in zip(places, grads) if g is None)
        appliers.append(Applier(optimizer, tuple(slots), tuple(places), no_gradient))
    return appliers, gradients


def escaped(value) -> bool:
    """Whether `value` is a tracer of another trace than the step's own (it leaked
    out of a `jax.checkpoint`, say, whose jaxpr cannot give it to the step)."""
    if not isinstance(value, jax.core.Tracer):
        return False
    try:
        from jax._src.core import trace_ctx
    except ImportError:  # a JAX without it: nothing to tell
        return False
    trace = getattr(value, "_trace", None)
    is_valid = getattr(trace, "is_valid", None)
    if callable(is_valid) and not is_valid():
        return True
    return trace is not trace_ctx.trace
