"""The accumulation state machine, written once with `keras.ops` for every backend.

A micro-batch moves a window record (`gradaccum.core.state.WINDOW`) through these
transitions:

1. **open**: the first micro-batch of a window reads its length from the `steps`
   schedule at the update it will make (`open_window`);
2. **admit**: its weight (`weigh`), the non-finite policy or loss scaling's screen
   (`screen`), loss scaling's unscale and its scale's reaction (`react`); an accepted
   micro-batch's gradient is added to the sums with its weight, a skipped one only
   counts towards the window's length (`admit`);
3. **decide**: is the window due (`steps` micro-batches, the schedule's length, or a
   weight budget reached), or did the data end inside it (`partial`: flush, carry,
   drop)? (`due`, `decide`);
4. **close**: one optimizer update with the combined gradient (`combine`), the
   update recorded, the window emptied (`close`).

The transitions read and write the fields of a record by name, and ask it for the
few things that differ per backend (its primitives, declared in
`gradaccum.backend_interface.Record`):

- where the fields and the sums live (`get`, `set`, `add`, `sums`);
- the sum's add (`add_sums`: in place and sparse on TensorFlow, `where` on JAX);
- conditional execution (`close`: TensorFlow's functional `If` kept whole, JAX's
  `lax.cond`), and the optimizer update itself (`apply`);
- the non-finite check (`all_finite`), what an error does (`fail`: raise, or
  record it for `fit` to raise), the privacy noise (`noised`), the loss scale's
  variables (`loss_scale`).

The fit record (`gradaccum.core.state.FIT`) adds the epoch's end (`end_of_data`)
and the loss terms' ratios (`track_terms`); the noise scale is `core.noise_scale`'s.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import keras
import numpy as np

from gradaccum.core import noise_scale, overwrite, screening
from gradaccum.core.combine import combine
from gradaccum.core.loss_scaling import react
from gradaccum.core.messages import warn_no_compiled_loss
from gradaccum.core.policy import Policy
from gradaccum.core.state import RESET
from gradaccum.core.validation import callable_weight

ops = keras.ops


# Reading -----------------------------------------------------------------------------


def window_length(record):
    """Micro-batches in the open window, skipped ones included."""
    return record.get("micro_step") + record.get("window_skipped")


def _where(condition, new, old):
    return ops.where(condition, ops.cast(new, old.dtype), old)


# Open and admit ------------------------------------------------------------------------


def open_window(policy: Policy, record) -> None:
    """A window opens with this micro-batch: its length is the schedule's at the
    update it will make, read then only (a callable's value below 1 is an error)."""
    rule = policy.rule
    if not rule.scheduled:
        return
    opening = window_length(record) == 0
    length = _scheduled_length(rule, record, opening)
    if callable(rule.steps):
        record.fail(opening & (length < 1), "schedule", at=record.get("updates"),
                    value=length)
        length = ops.maximum(length, 1)
    record.set("window_steps", length)


def _scheduled_length(rule, record, opening):
    """The open window's length under a schedule: read at the update it will make
    where the window is `opening`, else the one it opened with (a
    `NoiseScaleSchedule`'s: `noise_scale.followed_length`)."""
    if rule.follows:
        return noise_scale.followed_length(rule.steps, record, opening)

    def read():
        return ops.cast(rule.length(record.get("updates")), "int32")

    def kept():
        return ops.cast(record.get("window_steps"), "int32")

    return record.cond(opening, read, kept)


def loss_unit(policy: Policy, record, weight, replicas: int = 1, length=None, fit=None):
    """What a step divides its weighted loss `w_i * L_i` by where the window updates
    `overwrite_with_gradient` variables (Keras's float8 layers), under reduction
    "mean": the window's expected total weight `E` (the weight it holds, plus `w_i`
    for this micro-batch and each one still to come, times the replicas; a weight
    budget's budget). Where the window's micro-batches weigh alike (and for its last
    one always) the gradient flowing back through the model is then the large
    batch's, as float8 quantizes it, and the gradients, times `E` (`micro_batch`'s
    `unit`), are the weighted ones the sums take. (What float8 measures of it is the
    window's in any case: `overwrite.measured`.) None elsewhere: nothing changes for
    a model without such variables.

    Args:
        weight: the micro-batch's `w_i`.
        replicas: the replicas whose micro-batches make the window together.
        length: the window's length in micro-batches where the caller knows it
            (split mode: the batch's samples over the split's micro-batch size,
            fractional where the last micro-batch is smaller: that one then expects
            only its own weight still to come).
        fit: the fit record, whose epoch length (where known) shortens the
            expected length of the window the data ends in under `partial="flush"`.
    """
    if not any(record.overwrites) or not policy.mean:
        return None
    weight = ops.cast(weight, "float32")
    if policy.rule.weight_per_update is not None and length is None:
        return ops.cast(policy.rule.weight_per_update, "float32") * ops.ones_like(weight)
    # The weight the window holds already, and this micro-batch's for each one
    # still to come (exact for the window's last micro-batch; for all of them
    # where the micro-batches weigh alike).
    held = ops.cast(record.get("total_weight"), "float32")
    to_come = _to_come(policy, record, length, fit)
    expected = held + weight * ops.maximum(to_come, 1.0)
    # A window that weighs nothing so far (a micro-batch whose every element is
    # masked opens it) divides by 1: its loss is 0 whatever it is divided by.
    return ops.where(expected > 0, expected, 1.0) * float(replicas)


def unequal(policy: Policy, record, weight, length=None, fit=None):
    """Whether this micro-batch weighs otherwise than its window's micro-batches so
    far expected each one still to come to weigh (their mean), where the window
    updates float8 layers through `loss_unit`: float8 then quantized theirs at
    another size than the large batch's. A boolean tensor, or None where nothing is
    expected (no float8 layers, a weight budget). The step passes it to
    `micro_batch`; `length`, `fit`: `loss_unit`'s."""
    if not any(record.measured) or not policy.mean or (
            policy.rule.weight_per_update is not None and length is None):
        return None
    held = ops.cast(record.get("total_weight"), "float32")
    count = ops.cast(record.get("micro_step"), "float32")
    to_come = _to_come(policy, record, length, fit)
    assumed = held / ops.maximum(count, 1.0) * to_come
    expected = ops.cast(weight, "float32") * ops.maximum(to_come, 1.0)
    # (Micro-batches that weighed nothing differentiated nothing float8 could round.)
    return (held > 0) & (ops.abs(assumed - expected) > 1e-6 * (held + expected))


def _to_come(policy: Policy, record, length, fit):
    """The micro-batches the open window expects from this one on, this one
    included (fractional in split mode where the last is smaller): its length (the
    caller's, the rule's, the epoch's rest where the data ends in it under
    `partial="flush"` and its length is known), less those it holds."""
    rule = policy.rule
    before = ops.cast(window_length(record), "float32")
    if length is not None:
        length = ops.cast(length, "float32")
    elif rule.constant is not None or rule.scheduled:
        if rule.constant is not None:
            length = float(rule.constant)
        else:
            length = ops.cast(_scheduled_length(rule, record, window_length(record) == 0),
                              "float32")
        if fit is not None and policy.partial == "flush" and fit.has("epoch_length"):
            # The window the data ends in holds what is left of the epoch.
            epoch_length = fit.get("epoch_length")
            left = ops.cast(epoch_length - fit.get("epoch_step") + 1, "float32")
            length = ops.where(epoch_length > 0, ops.minimum(length, before + left), length)
    else:
        length = 1.0
    return length - before


def loss_factor(policy: Policy, record, weight, *, weighted: bool, direct: bool = False,
                **unit_options):
    """`(factor, unit)`: what a step multiplies the micro-batch's loss by before it
    differentiates it (None: nothing), and the `loss_unit` it divided by, a `Unit`
    (None where it did not: `micro_batch`'s `unit`). With `overwrite_with_gradient` variables
    `w_i / E`; else `w_i` where the step weighs its loss (`weighted`). A window of one
    micro-batch (`direct`) takes its loss as it is. `unit_options`: `loss_unit`'s."""
    unit = None if direct else loss_unit(policy, record, weight, **unit_options)
    if unit is not None:
        options = {k: v for k, v in unit_options.items() if k in ("length", "fit")}
        return ops.cast(weight, "float32") / unit, Unit(
            unit, unequal(policy, record, weight, **options))
    return (weight if weighted else None), None


class Unit(NamedTuple):
    """What a step divided a micro-batch's weighted loss by (`loss_unit`), with
    whether the micro-batch weighs otherwise than its window expected (`unequal`,
    or None), as `loss_factor` hands them to `micro_batch`."""

    value: object
    unequal: object


def weigh(policy: Policy, x, y, sample_weight, normalizers, record, *, warn=True):
    """`w_i` of a micro-batch: 1 (uniform), the user's callable (a value below 0 or
    nan is an error, and counts as 0), the compiled loss's normalizer (exact), else the
    micro-batch's size (with a warning once where `warn`: gradaccum's own step found
    no compiled loss). A float32 scalar."""
    weighting = policy.weighting
    if weighting == "uniform":
        return ops.convert_to_tensor(1.0, "float32")
    if callable(weighting):
        weight = callable_weight(weighting, x, y, sample_weight)
        valid = weight >= 0  # False for a negative weight and for nan
        record.fail(~valid, "negative_weight", at=window_length(record) + 1)
        return record.checked(ops.where(valid, weight, 0.0))
    if not normalizers:
        if warn:
            warn_no_compiled_loss()
        return samples(x)
    return ops.cast(normalizers[0], "float32")


def samples(x):
    """A micro-batch's number of samples (its first input's leading dimension, as
    Keras's step counts a batch), a float32 scalar."""
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return ops.cast(ops.shape(first)[0], "float32")


def screen(policy: Policy, record, gradients, loss_scaled: bool = False):
    """Whether the micro-batch is accumulated (a boolean tensor): its gradients are
    finite (`"skip"`, `"raise"`, and always under loss scaling), or the user's
    `nonfinite` callable keeps it; every micro-batch under `"apply"`. A non-finite
    gradient under `"raise"` (without loss scaling) is an error. An
    `overwrite_with_gradient` variable's value is not a gradient: never screened."""
    nonfinite = policy.nonfinite
    gradients = overwrite.ordinary(gradients, record.overwrites)
    if loss_scaled:
        # An overflow is expected now and then: always skipped, never raised.
        accept = record.all_finite(gradients)
        if callable(nonfinite):
            accept = accept & ~screening.user_skip(nonfinite, gradients)
        return accept
    if nonfinite == "apply":
        return ops.convert_to_tensor(True)
    if callable(nonfinite):
        return ~screening.user_skip(nonfinite, gradients)
    finite = record.all_finite(gradients)
    if nonfinite == "raise":
        record.fail(~finite, "nonfinite", at=window_length(record) + 1)
    return record.checked(finite)


def admit(policy: Policy, record, gradients, weight, accept, factor=None,
          direct: bool = False, divisor=None) -> None:
    """Adds an accepted micro-batch to the window: its gradients times `factor`
    (None: as they are, weighted already) to the sums, its weight to the total; a
    skipped one counts towards the window's length only. `direct`: the window is
    this one micro-batch, whose gradients go to the update as they are (no sums).
    An `overwrite_with_gradient` variable's value is kept as the window's elementwise
    maximum instead, never weighted nor summed; a measurement of the gradient
    (`overwrite.measured`) first times `divisor`, what the step divided the summed
    loss by (reduction "mean"; None: 1)."""
    if not direct:
        overwrites = record.overwrites
        record.add_sums(overwrite.ordinary(gradients, overwrites), factor, accept)
        if any(overwrites):
            kept = record.sums()
            first = record.get("micro_step") == 0
            values = overwrite.values(gradients, overwrites)
            if policy.mean and divisor is not None:
                values = [overwrite.in_units(v, divisor) if v is not None and flag else v
                          for v, flag in zip(values, record.measured)]
            new = overwrite.maxima(kept, values, first)
            record.set_sums([_where(accept, value, old) if flag else None
                             for value, old, flag in zip(new, kept, overwrites)])
    taken = ops.cast(accept, "int32")
    record.add("micro_batches", 1)
    record.add("micro_step", taken)
    record.add("window_skipped", 1 - taken)
    if record.counts_skips:
        record.add("skipped", 1 - taken)
    total = record.get("total_weight")
    record.set("total_weight", total + ops.where(accept, ops.cast(weight, total.dtype), 0))
    if record.has("received"):
        received = record.get("received")
        # (From a NumPy array: Keras's torch backend converts a Python list
        # element by element.)
        given = ops.convert_to_tensor(
            np.asarray([g is not None for g in gradients], "float32"), received.dtype)
        record.set("received", received + given * ops.cast(accept, received.dtype))


def track_terms(fit, record, normalizers) -> None:
    """Several loss terms weigh a window exactly with one weight only while their
    normalizers keep the same ratios across it: a window where they differ marks
    the fit `inexact` (warned once)."""
    kept = fit.get("term_ratios")
    if not normalizers or len(normalizers) < 2:
        return
    if len(normalizers) - 1 > kept.shape[0]:
        # The state was made before the compiled loss was built, for fewer terms
        # than it computes (a subclassed model with several outputs and one loss).
        warnings.warn(
            f"weighting='exact' cannot check {len(normalizers) - 1 - kept.shape[0]} of "
            f"this model's {len(normalizers)} compiled loss terms for normalizers "
            "that change their ratios within a window (the accumulation state was "
            "made before Keras built the compiled loss): where they do (outputs with "
            "masks of their own), the accumulation is approximate without this "
            "warning. Give the compiled loss as a list or dict, one per output.",
            stacklevel=2,
        )
    slots = kept.shape[0]
    if not slots:
        return
    first = ops.cast(normalizers[0], "float32")
    ratios = ops.stack([ops.divide_no_nan(ops.cast(n, "float32"), first)
                        for n in normalizers[1:]])[:slots]
    if ratios.shape[0] < slots:
        # Fewer terms than slots: the others stay as they are.
        ratios = ops.concatenate([ratios, kept[ratios.shape[0]:]])
    # Ratios never set (a state restored without them, or made for fewer terms)
    # are taken from this micro-batch, as at a window's start.
    opening = (window_length(record) == 0) | ops.all(kept == 0)
    differs = ops.any(ops.abs(ratios - kept) > 1e-6 * ops.abs(kept))
    fit.set("inexact", fit.get("inexact") | (~opening & differs))
    fit.set("term_ratios", _where(opening, ratios, kept))


# Decide -------------------------------------------------------------------------------


def due(policy: Policy, record, total_weight=None):
    """Whether the open window is due: it holds `steps` micro-batches (the
    schedule's length for it), or its total weight (the record's `window_weight`
    unless given) reached the budget. False without a rule."""
    rule = policy.rule
    if rule.weight_per_update is not None:
        weight = record.window_weight() if total_weight is None else total_weight
        return weight >= ops.cast(rule.weight_per_update, weight.dtype)
    length = window_length(record)
    if rule.constant is not None:
        return length >= rule.constant
    if rule.scheduled:
        return (length > 0) & (length >= record.get("window_steps"))
    return ops.convert_to_tensor(False)


def end_of_data(fit):
    """Whether the micro-batch just seen is the last of the epoch's data (its
    length known)."""
    length = fit.get("epoch_length")
    return (length > 0) & (fit.get("epoch_step") >= length)


def decide(policy: Policy, is_due, end=None, ok=None):
    """`(apply, close)` for the open window: it closes when due or, at the end of
    the data (`end`), as `partial` says (`"flush"` applies it, `"drop"` discards
    it, `"carry"` keeps it open); it applies when it closes (`"drop"`: when it is
    due), if it holds an accepted micro-batch (the record's `close` tells). `ok`:
    False after an error, which closes nothing."""
    close = is_due
    if end is not None and policy.partial in ("flush", "drop"):
        close = close | end
    if ok is not None:
        close = close & ok
    apply = close
    if end is not None and policy.partial == "drop":
        apply = apply & is_due
    return apply, close


# Close --------------------------------------------------------------------------------


def combined(policy: Policy, record, sums=None, total_weight=None) -> list:
    """G from the window's sums (the record's unless given: the global window's
    under several replicas) with the privacy noise of its update, one tensor per
    variable in its dtype. An `overwrite_with_gradient` variable's entry is the
    window's kept value as it is."""
    sums = record.sums() if sums is None else sums
    overwrites = record.overwrites
    ordinary = record.noised(overwrite.ordinary(sums, overwrites))
    weight = record.get("total_weight") if total_weight is None else total_weight
    dtypes = record.dtypes()
    gradients = combine([ops.zeros((), "float32") if g is None else g for g in ordinary],
                        weight, policy.reduction, dtypes)
    if not any(overwrites):
        return gradients
    if policy.mean:
        # A measurement of the gradient, back from the window's summed loss.
        held = weight > 0
        inverse = ops.where(held, 1.0 / ops.where(held, weight, 1.0), 1.0)
        sums = [overwrite.in_units(value, inverse) if flag else value
                for value, flag in zip(sums, record.measured)]
    return [ops.cast(value, dtype) if flag else g
            for g, value, flag, dtype in zip(gradients, sums, overwrites, dtypes)]


def close(policy: Policy, record, apply, close, gradients=None, fit=None):
    """When `close`: one update with G when `apply` and the window holds an
    accepted micro-batch (the micro-batch's own `gradients` where given: a window of
    one micro-batch, which skipped the sums), recorded; the window emptied. `fit`:
    the fit record whose `largest_window` follows the windows applied (privacy).
    Returns whether an update happened."""

    def update():
        if gradients is None:
            sums = noise_scale.window_closed(record, record.sums(), record.get("total_weight"))
            record.apply(combined(policy, record, sums=sums))
        else:
            record.apply([None if g is None else ops.cast(g, dtype)
                          for g, dtype in zip(gradients, record.dtypes())])

    def finish(applied):
        recorded(record, applied, window_length(record), record.get("total_weight"), fit)
        emptied(record)

    if (gradients is None and fit is not None and fit.has("unequal")
            and any(record.measured) and policy.mean):
        # The window's float8 micro-batches were differentiated over a weight it did
        # not end with: flagged as unequal weights are (`micro_batch`).
        unequal = apply & record.holds() & _unexpected_weight(policy, record, fit)
        fit.set("unequal", fit.get("unequal") | unequal)
    return record.close(apply, close, update, finish, empty_sums=gradients is None)


def _unexpected_weight(policy: Policy, record, fit):
    """Whether a float8 window closing now holds another weight than its
    micro-batches' `loss_unit` expected: a weight budget's window above or below
    the budget; a window shorter than its length where the data ended before the
    epoch's known end or at an end `fit` could not know (a partial window flushed
    at the end of a generator). (A window the known end of an epoch shortens was
    expected so; a skip is `micro_batch`'s to flag.)"""
    rule = policy.rule
    if rule.weight_per_update is not None:
        weight = ops.cast(record.window_weight(), "float32")
        budget = float(rule.weight_per_update)
        return ops.abs(weight - budget) > 1e-6 * budget
    if rule.constant is not None:
        length = rule.constant
    elif rule.scheduled:
        length = record.get("window_steps")
    else:
        return ops.convert_to_tensor(False)
    early = ops.convert_to_tensor(True)
    if fit.has("epoch_length"):
        epoch_length = fit.get("epoch_length")
        early = (epoch_length <= 0) | (fit.get("epoch_step") < epoch_length)
    return (window_length(record) < length) & early


def recorded(record, apply, micro_batches, weight, fit=None) -> None:
    """Counts an update (where `apply`) and remembers what its window held: its
    micro-batches (skipped ones included) and total weight."""
    record.add("updates", ops.cast(apply, "int32"))
    record.set("last_window_micro_batches",
               _where(apply, micro_batches, record.get("last_window_micro_batches")))
    record.set("last_window_weight",
               _where(apply, weight, record.get("last_window_weight")))
    if fit is not None and fit.has("largest_window"):
        largest = fit.get("largest_window")
        fit.set("largest_window",
                _where(apply, ops.maximum(largest, ops.cast(weight, largest.dtype)),
                       largest))


def emptied(record) -> None:
    """The window's fields zeroed (its sums are the record's `close` to empty)."""
    for name in RESET:
        if record.has(name):
            record.set(name, ops.zeros_like(record.get(name)))


# A micro-batch, whole -------------------------------------------------------------------


class Outcome(NamedTuple):
    """What a micro-batch did to its window (each a boolean tensor or a Python
    bool): it was `accepted`, its window `applied` an update, its window `closed`
    (applied, or emptied without an update). `micro_batch` leaves it on the
    record as `record.outcome`, for what follows the window beside the sums (the
    moving statistics of batch normalization)."""

    accepted: object
    applied: object
    closed: object


def micro_batch(policy: Policy, record, gradients, weight, *, weighted=False,
                loss_scale=None, grows=True, end=None, fit=None, direct=False,
                closes=True, unit=None, samples=None, pieces=None):
    """One micro-batch's gradients through the window: open, screen, admit, and
    (where `closes`) decide and close. Returns whether it was accepted.

    Args:
        gradients: one per variable (None: no gradient for it).
        weight: the micro-batch's `w_i`.
        weighted: the gradients carry the weight already (the step differentiated
            `w_i * L_i`).
        loss_scale: the LossScaleOptimizer's `dynamic_growth_steps` when the loss
            was scaled (the gradients are unscaled here), else None.
        grows: whether the loss scale's growth counts this micro-batch (`react`).
        end: whether the data ends with this micro-batch (a boolean tensor), or
            None where nothing ends it.
        fit: the fit record (`largest_window`), or None.
        direct: a window of one micro-batch: applied from `gradients` as they are.
        closes: whether this call may close the window (False: `accumulate` only).
        unit: where the step differentiated `w_i * L_i / unit` (`loss_unit`): the
            gradients are taken times `unit` (and unscaled, under loss scaling). A
            `Unit` (`loss_factor`'s) also says whether the micro-batch weighs
            otherwise than its window expected: flagged in the fit record.
        samples, pieces: for the noise scale, the micro-batch's samples (None: its
            weight), and where the step cut it, its pieces (`noise_scale.add_piece`).
    """
    unequal = None
    if isinstance(unit, Unit):
        unit, unequal = unit
    open_window(policy, record)
    accept = screen(policy, record, gradients, loss_scaled=loss_scale is not None)
    factor = None
    if loss_scale is not None:
        factor = react(record, accept, loss_scale, grows)
        if unit is not None:
            factor = factor * ops.cast(unit, "float32")
        elif policy.mean and not weighted:
            factor = factor * ops.cast(weight, "float32")
    elif unit is not None:
        factor = unit
    elif policy.mean and not (weighted or direct):
        factor = weight
    ok = record.healthy() if policy.raises else None
    if ok is not None:
        # A step that cannot raise recorded an error: nothing of this micro-batch
        # is accumulated, and no window closes (fit raises after the call).
        accept = accept & ok
    # What the step divided the summed loss by: the unit, 1 for a weighted loss,
    # else the micro-batch's weight (the loss its own mean).
    divisor = unit if unit is not None else 1.0 if weighted else weight
    if unequal is not None and fit is not None and fit.has("unequal"):
        # float8 quantized the window's first micro-batches at another size than the
        # large batch's: this one weighs otherwise, or (skipped after an accepted
        # one) they were divided by a weight that counted it.
        flagged = accept & unequal
        if policy.rule.weight_per_update is None:
            flagged = flagged | (~accept & (record.get("micro_step") > 0))
        fit.set("unequal", fit.get("unequal") | flagged)
    if not direct:
        noise_scale.add_piece(record, gradients, factor, weight, accept, samples, pieces)
    admit(policy, record, gradients, weight, accept, factor, direct=direct,
          divisor=divisor)
    if not closes:
        record.outcome = Outcome(accept, False, False)
        return accept
    if direct:
        closing = ops.convert_to_tensor(True) if ok is None else ok
        applied = close(policy, record, accept, closing, gradients=gradients, fit=fit)
    else:
        apply, closing = decide(policy, due(policy, record), end, ok)
        applied = close(policy, record, apply, closing, fit=fit)
    record.outcome = Outcome(accept, applied, closing)
    return accept


def unclosed(policy: Policy, record, end=None) -> None:
    """After a micro-batch run by a step without the close (the host counted that
    its window closes nothing: `gradaccum.core.host_window`): an error ("miscount")
    where the window was due all the same, so that no window runs past its length
    unseen."""
    ok = record.healthy() if policy.raises else None
    _, closing = decide(policy, due(policy, record), end, ok)
    record.fail(closing, "miscount", at=window_length(record))


def apply_now(policy: Policy, record, condition=True, fit=None):
    """Closes the open window when `condition`, applying it if it holds an
    accepted micro-batch (a partial window normalized by its own weights). Returns
    whether an update happened."""
    condition = ops.convert_to_tensor(condition)
    return close(policy, record, condition, condition, fit=fit)


def reset(record) -> None:
    """Empties the open window, applying nothing."""
    emptied(record)
    record.empty_sums()


def drop(record):
    """Discards the open window if it holds a micro-batch (a window the data ended
    in, `partial="drop"`). Returns whether there was one."""
    nonempty = window_length(record) > 0
    record.close(ops.convert_to_tensor(False), nonempty, lambda: None,
                 lambda applied: emptied(record))
    return nonempty


# Logs and warnings -----------------------------------------------------------------------
