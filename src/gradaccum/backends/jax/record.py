"""The state machine's records inside JAX's jitted step.

`Carry` holds what the step works on (the trainer's trainable, optimizer and metric
values, and gradaccum's state unpacked by field name); the step's code changes its
attributes as it goes, a Python object of traced values. `WindowRecord` is one
accumulator's window record (`gradaccum.core.state.WINDOW`) in it, with JAX's
primitives for `gradaccum.core.transitions`: the sums' add as a `where`, the update
inside a `lax.cond` (only when a window closes), the bookkeeping of a close gated
by `where`, and errors recorded in the fit record for `fit` to raise after the
call (a jitted step cannot raise). `Runner` traces a `steps` callable as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gradaccum import _keras_common as kc
from gradaccum.backend_interface import Record
from gradaccum.backends.jax import privacy
from gradaccum.core import noise_scale
from gradaccum.core.state import ERRORS, accumulator_name
from gradaccum.core.window import ScheduleRunner, checked_schedule_value


def all_finite(gradients):
    """Whether every element of every gradient is finite: one boolean reduction per
    gradient (`all(isfinite)`, fused into one pass), joined by `&`, no branch.
    Measured on XLA's CPU client (`benchmarks/step.py`, MLP b=8 k=4) it costs less
    than half of what a float sum of `g * 0` per gradient did (the form before;
    BENCHMARKS.md, "JAX on a CPU")."""
    values = [g for g in gradients if g is not None]
    verdict = jnp.asarray(True)
    for v in values:
        verdict = verdict & jnp.all(jnp.isfinite(v))
    return verdict


class LossScaling:
    """Where a LossScaleOptimizer keeps its step counter, its scale and its inner
    optimizer's variables among its own variables (None-like when the optimizer is
    not one: `loss_scaled` False).

    Args:
        optimizer: a Keras optimizer.
    """

    def __init__(self, optimizer):
        self.loss_scaled = kc.is_loss_scale_optimizer(optimizer)
        if self.loss_scaled:
            slot = {id(v): i for i, v in enumerate(optimizer.variables)}
            self.counter_slot = slot[id(optimizer.step_counter)]
            self.scale_slot = slot[id(optimizer.dynamic_scale)]
            self.inner_slots = [slot[id(v)] for v in optimizer.inner_optimizer.variables]
            self.growth_steps = int(optimizer.dynamic_growth_steps)


class Carry:
    """The step's values, changed in place as the step traces: `trainable`,
    `non_trainable`, `optimizer` and `metrics` (lists, as the trainer's state holds
    them) and `fields` (gradaccum's state by field name)."""

    def __init__(self, trainable, non_trainable, optimizer, metrics, fields):
        self.trainable = list(trainable)
        self.non_trainable = list(non_trainable)
        self.optimizer = list(optimizer)
        self.metrics = list(metrics)
        self.fields = dict(fields)


class FitRecord(Record):
    """The fit record's fields in the carry (`gradaccum.core.state.FIT`)."""

    def __init__(self, carry: Carry):
        self.carry = carry

    def has(self, name: str) -> bool:
        return name in self.carry.fields

    def get(self, name: str):
        return self.carry.fields[name]

    def set(self, name: str, value) -> None:
        old = self.carry.fields[name]
        self.carry.fields[name] = jnp.asarray(value).astype(old.dtype)

    def fail(self, error, code: str, at, value=None) -> None:
        """Records the first error (its code, where, and the micro-batch's number);
        `fit` raises it after the call."""
        fields = self.carry.fields
        first = (fields["error"] == 0) & error
        fields["error"] = jnp.where(first, ERRORS[code], fields["error"]).astype("int32")
        fields["error_at"] = jnp.where(first, at, fields["error_at"]).astype("int32")
        fields["error_micro_batch"] = jnp.where(
            first, fields["micro_batches"] + 1, fields["error_micro_batch"]
        ).astype("int32")

    def cond(self, pred, true_fn, false_fn):
        return jax.lax.cond(pred, lambda: true_fn(), lambda: false_fn())

    def healthy(self):
        """No error recorded: the micro-batch may accumulate and close windows (None
        where an error stops nothing: a custom loop's)."""
        if not getattr(self, "gates_errors", True):
            return None
        return self.carry.fields["error"] == 0


class WindowRecord(FitRecord):
    """One accumulator's window record in the carry: its fields under `prefix`, the
    sums of the trainable variables its optimizer updates.

    Args:
        carry: the step's `Carry`.
        step: what the record needs of its step (a `TrainStep`, a
            `GradientAccumulator`): `variable_dtypes`, `loss_scaled` (and then
            `counter_slot`, `scale_slot`, `inner_slots`: where a LossScaleOptimizer's
            step counter, scale and inner optimizer's variables sit among its
            variables), `privacy` and `noise_key`.
        applier: the `Applier` whose optimizer applies this window.
        prefix: the record's field names' prefix ("" for the first).
    """

    def __init__(self, carry: Carry, step, applier, prefix: str = ""):
        super().__init__(carry)
        self.step = step
        self.applier = applier
        self.prefix = prefix
        self.slots = applier.variable_slots
        flags, measured = getattr(step, "overwrites", ()), getattr(step, "measured", ())
        if flags and any(flags[i] for i in self.slots):
            self.overwrites = tuple(flags[i] for i in self.slots)
            self.measured = tuple(measured[i] for i in self.slots)
        # `fit` raises a recorded error after the call, and nothing trains until
        # then; a custom loop's step goes on (`GradientAccumulator.check`).
        self.gates_errors = getattr(step, "gates_errors", True)

    # Fields: this record's under its prefix, the fit record's as they are.

    def _key(self, name: str) -> str:
        key = self.prefix + name
        return key if key in self.carry.fields else name

    def has(self, name: str) -> bool:
        return self._key(name) in self.carry.fields

    def get(self, name: str):
        return self.carry.fields[self._key(name)]

    def set(self, name: str, value) -> None:
        super().set(self._key(name), value)

    def fail(self, error, code: str, at, value=None) -> None:
        fields = self.carry.fields
        first = (fields["error"] == 0) & error
        super().fail(error, code, at, value)
        # The micro-batch's number is the record's count of those presented.
        fields["error_micro_batch"] = jnp.where(
            first, self.get("micro_batches") + 1, fields["error_micro_batch"]
        ).astype("int32")

    # Primitives ---------------------------------------------------------------------

    def sums(self) -> list:
        """The window's sums; kept per device (`device_sums`), as one."""
        rows = getattr(self.step, "rows", None)
        return [self.carry.fields[accumulator_name(i)] if rows is None
                else rows.whole(i, self.carry.fields[accumulator_name(i)])
                for i in self.slots]

    def dtypes(self) -> list:
        return [self.step.variable_dtypes[i] for i in self.slots]

    def all_finite(self, gradients):
        if not self.has("noise_pieces_norm"):
            return all_finite(gradients)
        # With the noise scale, its squared norm is the screen's pass too: finite
        # decides; else (an inf, a nan, or squares that overflowed) the element-wise
        # check, in a branch that runs only then.
        squared = self.norm_of(gradients)
        self.screened(gradients, squared)
        return jax.lax.cond(jnp.isfinite(squared), lambda: jnp.asarray(True),
                            lambda: all_finite(gradients))

    def add_sums(self, gradients, factor, accept) -> None:
        fields = self.carry.fields
        rows = getattr(self.step, "rows", None)
        for i, g in zip(self.slots, gradients):
            if g is None:
                continue
            name = accumulator_name(i)
            total = fields[name]
            if factor is not None:
                g = g * jnp.asarray(factor).astype(g.dtype)
            fields[name] = jnp.where(accept, total + g.astype(total.dtype), total)
            if rows is not None:
                fields[name] = rows.constrain(i, fields[name])

    def close(self, apply, close, update, finish, empty_sums=True):
        carry = self.carry
        apply = jnp.asarray(apply) & self.holds()

        # The fields the update writes (the noise scale's sums): carried through it.
        written = [self.prefix + name for name in noise_scale.TOTALS
                   if self.prefix + name in carry.fields]

        def branch(run):
            def fn(operands):
                carry.trainable, carry.optimizer = list(operands[0]), list(operands[1])
                carry.fields.update(zip(written, operands[2]))
                if run:
                    update()
                return (list(carry.trainable), list(carry.optimizer),
                        [carry.fields[name] for name in written])

            return fn

        carry.trainable, carry.optimizer, values = jax.lax.cond(
            apply, branch(True), branch(False),
            (list(carry.trainable), list(carry.optimizer),
             [carry.fields[name] for name in written]))
        carry.fields.update(zip(written, values))
        # The bookkeeping is scalars: computed, and kept where the window closes.
        before = dict(carry.fields)
        finish(apply)
        for name, value in carry.fields.items():
            if value is not before[name]:
                carry.fields[name] = jnp.where(close, value, before[name])
        if empty_sums:
            for i in self.slots:
                name = accumulator_name(i)
                carry.fields[name] = jnp.where(close, jnp.zeros_like(carry.fields[name]),
                                             carry.fields[name])
        return apply

    def set_sums(self, values) -> None:
        fields = self.carry.fields
        for i, value in zip(self.slots, values):
            if value is not None:
                name = accumulator_name(i)
                fields[name] = jnp.asarray(value).astype(fields[name].dtype)

    def empty_sums(self) -> None:
        for i in self.slots:
            name = accumulator_name(i)
            self.carry.fields[name] = jnp.zeros_like(self.carry.fields[name])

    def apply(self, gradients) -> None:
        """The window's update: its optimizer's `stateless_apply` on its variables
        (under loss scaling the inner optimizer's: the gradients are unscaled and
        finite already)."""
        carry, applier, step = self.carry, self.applier, self.step
        optimizer, slots = applier.optimizer, applier.optimizer_slots
        if step.loss_scaled:
            optimizer = optimizer.inner_optimizer
            slots = [slots[i] for i in step.inner_slots]
        arguments = (
            [carry.optimizer[i] for i in slots],
            [None if p in applier.no_gradient else g for p, g in zip(self.slots, gradients)],
            [carry.trainable[p] for p in self.slots],
        )
        # The optimizer's own method: a model's own step has it recorded meanwhile.
        if not self.has("received"):
            new_variables, new_optimizer = type(optimizer).stateless_apply(optimizer,
                                                                           *arguments)
        else:
            # Where a gradient may be missing at run time (a custom loop): a variable
            # the window gave none is left out of the update, as Keras leaves out a
            # None gradient (no step, no slot change, no decay).
            received = self.get("received") > 0
            keep = {id(v): received[k] for k, v in enumerate(kc.built_variables(optimizer))}
            with kc.stateless_updating_only(optimizer, keep):
                new_variables, new_optimizer = type(optimizer).stateless_apply(optimizer,
                                                                               *arguments)
            new_variables = [jnp.where(received[k], new, old)
                             for k, (new, old) in enumerate(zip(new_variables, arguments[2]))]
        for p, value in zip(self.slots, new_variables):
            carry.trainable[p] = value
        for i, value in zip(slots, new_optimizer):
            carry.optimizer[i] = value

    def noised(self, sums) -> list:
        step = self.step
        if step.privacy is None:
            return sums
        return privacy.noised(sums, step.privacy, step.noise_key, self.get("updates"))

    def loss_scale(self):
        step = self.step
        if not step.loss_scaled:
            return None
        optimizer = self.carry.optimizer
        return optimizer[step.counter_slot], optimizer[step.scale_slot]

    def set_loss_scale(self, counter, scale) -> None:
        step = self.step
        self.carry.optimizer[step.counter_slot] = counter
        self.carry.optimizer[step.scale_slot] = scale


def where_accepted(accepted, new, old) -> list:
    """Variables after a micro-batch (`new`: non-trainable ones, statistics and
    seeds, or the metrics'), or as they were (`old`) where it was not accumulated
    (skipped: it never reaches the weights nor the logs)."""
    return [jnp.where(accepted, n, o) for n, o in zip(new, old)]


class Runner(ScheduleRunner):
    """How the jitted step runs a `steps` callable: traced as it is (checked
    traceable when the rule is made, before a step is)."""

    def prepare(self, steps):
        try:
            jax.eval_shape(lambda index: checked_schedule_value(steps(index)),
                           jax.ShapeDtypeStruct((), "int32"))
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError) as error:
            raise ValueError(
                "The `steps` callable must be traceable by JAX: written with "
                "`keras.ops` / `jax.numpy` (`jnp.where` rather than a Python `if` "
                "on the update index). Received: a callable that failed on a "
                f"traced update index: {type(error).__name__}"
            ) from None
        return steps
