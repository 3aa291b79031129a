"""A model's own JAX `train_step(state, data)`, run as written, its optimizer calls
accumulated.

While the step runs, every optimizer the model holds (`self.optimizer`, a GAN's
`self.g_optimizer` / `self.d_optimizer`, one in a list or dict attribute) has its
`stateless_apply` replaced by the `ApplyRouter`'s: the gradients the step hands over
go through that optimizer's window record (`gradaccum.core.transitions`: screened,
weighted, added, and when the window is due or the data ends, applied), and the call
returns the variables as the window left them: updated when it closed, as they were
otherwise. So a step that updates one network and then differentiates through it
(keras.io's DCGAN order) sees the update wherever a window is due, as on
TensorFlow and as plain Keras at `steps=1`.

Each handed array is found in the state the trainer carries (by identity: the step
slices the state it received); each optimizer applies its window with one
`stateless_apply` on its variables only (`Applier`).

Keras's JAX trainer carries `self.optimizer`'s variables; a model with several
optimizers carries theirs in that place of the state (its `_get_jax_state` and
`jax_state_sync` put them there), and hands each optimizer its slice of it.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras

from gradaccum import _keras_common as kc
from gradaccum.backends.jax.record import FitRecord, WindowRecord, where_accepted
from gradaccum.backends.jax.state import window_prefix
from gradaccum.core import fit_logs
from gradaccum.core import transitions as tr
from gradaccum.core.validation import check_optimizer


class Applier(NamedTuple):
    """One optimizer's share of the state: where its variables sit among the
    state's optimizer variables (in `optimizer.variables`' order), which trainable
    variables it updates, and which of those it receives no gradient for (`None`
    in the step, skipped by Keras's optimizers as they are)."""

    optimizer: Any  # a keras.optimizers.Optimizer
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


def run(step, carry, data) -> dict:
    """`steps` mode with the model's own `train_step(state, data)` (`step.own_step`):
    it runs as written, each optimizer call through its window (`ApplyRouter`).
    Returns the step's logs; `carry` holds the state after it."""
    model = step.model
    fit = FitRecord(carry)
    fit.add("epoch_step", 1)
    theirs = [i for i in range(len(carry.metrics)) if i not in step.slots.values()]
    step_name = f"{type(model).__name__}.train_step"
    entry_non_trainable = list(carry.non_trainable)
    router = ApplyRouter(step, carry, data, tr.end_of_data(fit), step_name)
    step.normalizers.start()
    with router.recording(), step.follower.observing():
        logs, state = step.own_step(
            (list(carry.trainable), list(carry.non_trainable), list(carry.optimizer),
             [carry.metrics[i] for i in theirs]),
            data,
        )
    if not router.appliers:
        raise ValueError(
            f"The train_step of {type(model).__name__} must hand its gradients to "
            "the model's optimizer (`self.optimizer.stateless_apply(...)`) for "
            "gradaccum to accumulate them. Received: a step that did not call it, "
            "so nothing would be trained."
        )
    check_loss_scaled_appliers(step, router.appliers, step_name)
    step.appliers = dict(router.appliers)
    step.appliers_known = True
    trainable_out, non_trainable_out, optimizer_out, metrics_out = state
    updated = set().union(*(a.variable_slots for a in step.appliers.values()))
    if any(trainable_out[i] is not carry.trainable[i] for i in sorted(updated)):
        raise ValueError(
            "A model's own `train_step` must return the trainable variables each "
            "optimizer's `stateless_apply` gave it, unchanged, for gradaccum to "
            "apply the window's update: what the step does to the variables after "
            "that call would be lost where a window stays open. Received: "
            f"{step_name} changed them after the call (a clip or a constraint? put "
            "it in the layers' `kernel_constraint` or an optimizer option)."
        )
    if len(optimizer_out) != len(carry.optimizer) or any(
        a is not b for a, b in zip(optimizer_out, carry.optimizer)
    ):
        raise ValueError(
            "A model's own `train_step` must return the optimizer variables of its "
            "state as the optimizers' `stateless_apply` gave them back: gradaccum "
            "updates them when a window closes. Received: "
            f"{step_name} returned others (an optimizer gradaccum does not reach "
            "as an attribute of the model, or a change of its own?)."
        )
    accepted = jnp.any(jnp.stack(router.accepted))
    carry.non_trainable = [jnp.where(accepted, new, old)
                           for new, old in zip(non_trainable_out, entry_non_trainable)]
    # The moving statistics follow the first optimizer call's window (every
    # optimizer's saw the same micro-batches).
    step.follow(carry, entry_non_trainable, non_trainable_out,
                router.outcomes[0]._replace(accepted=accepted))
    entry_metrics = list(carry.metrics)
    for i, value in zip(theirs, metrics_out):
        carry.metrics[i] = value
    logs = dict(logs)
    if fit_logs.tracks_skips(step.policy, step.loss_scaled):
        # The step's own trackers leave out a micro-batch any of its optimizers
        # skipped, as Keras's step's do.
        used = jnp.all(jnp.stack(router.accepted))
        moved, _ = step.stateless_metrics(carry.metrics, None, None,
                                          model.get_metrics_result)
        carry.metrics = where_accepted(used, carry.metrics, entry_metrics)
        trackers, _ = step.stateless_metrics(carry.metrics, None, None,
                                             model.get_metrics_result)
        logs = fit_logs.kept_logs(used, logs, trackers, moved)
    return logs


def loss_scaling_fits(step, appliers) -> bool:
    """Whether the optimizers a step hands gradients to (`appliers`, by record) fit
    loss scaling: a `LossScaleOptimizer` applies as the model's optimizer on its
    whole state, or none is one."""
    model = step.model
    appliers = list(appliers.values())
    scaled = [a for a in appliers if kc.is_loss_scale_optimizer(a.optimizer)]
    if not (scaled or step.loss_scaled):
        return True
    whole = Applier.whole(model.optimizer, len(model.trainable_variables))
    applier = appliers[0]
    return len(appliers) == 1 and (
        applier.optimizer is whole.optimizer
        and applier.optimizer_slots == whole.optimizer_slots
        and applier.variable_slots == whole.variable_slots
    )


def check_loss_scaled_appliers(step, appliers, step_name) -> None:
    """Refuses a step whose optimizers do not fit loss scaling (`loss_scaling_fits`)."""
    if not loss_scaling_fits(step, appliers):
        raise ValueError(
            "On Keras's JAX backend gradaccum scales losses (a LossScaleOptimizer) "
            "for a model's own `train_step` that hands all its gradients to the "
            "model's optimizer, `self.optimizer`, with the state's optimizer "
            f"variables. Received: {step_name} handing them to "
            f"{len(appliers)} optimizer(s), a LossScaleOptimizer among them, "
            "or part of them."
        )


class ApplyRouter:
    """What the model's own step hands to each optimizer's `stateless_apply` (at
    most once per optimizer and step), taken through that optimizer's window.

    Args:
        step: the `TrainStep`.
        carry: the step's `Carry` (the state the model's step received).
        data: the micro-batch.
        end: whether the data ends with this micro-batch (a boolean).
        step_name: the model's step, as errors name it.
    """

    def __init__(self, step, carry, data, end, step_name: str):
        self.step = step
        self.carry = carry
        self.micro_batch = keras.utils.unpack_x_y_sample_weight(data)
        self.end = end
        self.step_name = step_name
        # Where the state's arrays sit, as the model's step received them.
        self.position = {id(t): i for i, t in enumerate(carry.trainable)}
        self.slot = {id(v): i for i, v in enumerate(carry.optimizer)}
        # The record index of each optimizer the step handed gradients to, in order.
        self.appliers: dict[int, Applier] = {}
        self.accepted: list = []
        self.outcomes: list = []

    def recorder(self, name, optimizer):
        known = [i for i, other in enumerate(self.step.optimizers) if other is optimizer]

        def stateless_apply(optimizer_variables, grads, trainable_variables):
            if not known:
                raise ValueError(
                    "gradaccum keeps a window for each optimizer the model holds when "
                    f"it is compiled. Received: `self.{name}` in {self.step_name}, an "
                    "optimizer the model did not hold then; assign it before `compile` "
                    "(or compile again)."
                )
            index = known[0]
            if index in self.appliers:
                raise ValueError(
                    "On Keras's JAX backend a model's own `train_step` must hand its "
                    f"gradients to `self.{name}.stateless_apply` once per step for "
                    "gradaccum to accumulate them. Received: a second call in one step "
                    f"of {self.step_name}."
                )
            applier = self.applier(optimizer, name, optimizer_variables, grads,
                                   trainable_variables)
            self.appliers[index] = applier
            if not loss_scaling_fits(self.step, self.appliers):
                # Refused after the step, with every optimizer it hands gradients to.
                return list(trainable_variables), list(optimizer_variables)
            return self.accumulate(index, applier, list(grads))

        return stateless_apply

    def applier(self, optimizer, name, optimizer_variables, grads, variables) -> Applier:
        """The share of the state the call handed over."""
        check_optimizer(optimizer)
        step_name = self.step_name
        if len(grads) != len(variables):
            raise ValueError(
                f"The gradients a model's own `train_step` hands to `self.{name}."
                "stateless_apply` must be one per trainable variable handed with them. "
                f"Received: {len(grads)} gradients for {len(variables)} variables in "
                f"{step_name}."
            )
        slots = [self.slot.get(id(v)) for v in optimizer_variables]
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
        found = [self.position.get(id(v)) for v in variables]
        if None in found:
            raise ValueError(
                "A model's own `train_step` must hand "
                f"`self.{name}.stateless_apply` the trainable variables of the step's "
                "`state` as it received them, for gradaccum to update them when a "
                f"window closes. Received: a value computed from them in {step_name}."
            )
        places = [p for p in found if p is not None]  # all of them (checked above)
        for applier in self.appliers.values():
            shared = set(places) & set(applier.variable_slots)
            if shared:
                other = kc.optimizer_name(self.step.model, applier.optimizer)
                raise ValueError(
                    "Each trainable variable of a model's own `train_step` must be "
                    "handed to one optimizer. Received: variable "
                    f"{min(shared)} of the state handed to `self.{other}` and "
                    f"`self.{name}` in {step_name}."
                )
        no_gradient = frozenset(p for p, g in zip(places, grads) if g is None)
        return Applier(optimizer, tuple(slots), tuple(places), no_gradient)

    def accumulate(self, index, applier, grads):
        """The call's gradients through window record `index`: returns the
        variables and optimizer variables as the window leaves them (updated where
        it closed)."""
        step = self.step
        policy = step.policy
        carry = self.carry
        x, y, sample_weight = self.micro_batch
        # The normalizers the compiled loss recorded since the previous call (the
        # previous call's where it recorded none: the step computed its loss once).
        normalizers = step.normalizers.since_last_call()
        if policy.weighting == "exact" and any(escaped(n) for n in normalizers):
            raise ValueError(
                "weighting='exact' reads each micro-batch's loss normalizer where the "
                "compiled loss computes it; a model's own `train_step` that computes "
                "its loss inside a JAX transformation of its own (`jax.checkpoint`, "
                "`lax.scan`, `vmap`) keeps that value inside it. Received: a normalizer "
                f"that escaped such a transformation in {self.step_name}. "
                "Pass weighting='uniform' (equal micro-batches) or a `weighting` "
                "callable of the micro-batch."
            )
        record = WindowRecord(carry, step, applier, window_prefix(index))
        fit = FitRecord(carry)
        # (A step with a loss of its own is weighted by size, as the contract says:
        # nothing to warn about.)
        weight = jax.lax.stop_gradient(
            tr.weigh(policy, x, y, sample_weight, normalizers, record, warn=False)
        )
        tr.track_terms(fit, record, normalizers)
        accepted = tr.micro_batch(
            policy, record, grads, weight,
            loss_scale=step.growth_steps if step.loss_scaled else None,
            end=self.end, fit=fit,
        )
        self.accepted.append(accepted)
        self.outcomes.append(record.outcome)
        return ([carry.trainable[p] for p in applier.variable_slots],
                [carry.optimizer[i] for i in applier.optimizer_slots])

    @contextlib.contextmanager
    def recording(self):
        """While the step runs: each optimizer's `stateless_apply` goes through its
        window, and gradaccum's state is not among the model's metrics (the step
        updates those it finds)."""
        model = self.step.model
        hidden = self.step.state
        routed = kc.named_optimizers(model)
        metrics = kc.model_metrics(model)
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
