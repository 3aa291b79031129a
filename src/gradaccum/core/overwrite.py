"""Variables whose "gradient" is their new value (`overwrite_with_gradient`).

Keras marks a variable `overwrite_with_gradient` when the training step computes its
next value rather than a direction to descend: the scales and amax histories of
Keras's float8 layers (`model.quantize("float8")`), or a variable a user marks so.
Keras's optimizer assigns such a "gradient" to its variable, before it updates the
others, and leaves it out of everything else (loss scaling, clipping, decay).

Through a window such a value is never weighted, summed, noised or screened as a
gradient. The window keeps the elementwise maximum of its accepted micro-batches'
values (for float8: the amax of the whole window's tensors, what one step on the
window as one batch computes, since every micro-batch of a window sees the same scale
and history) in the variable's sum, and the window's update hands that maximum to
the optimizer, once, when the window closes. A skipped micro-batch leaves it; a
dropped window leaves the variable as it leaves the others.

One entry measures the gradient itself, whose size is the loss's: the newest amax of
a float8 layer's output-gradient history (`measured`). A micro-batch's is taken in the
units of the window's summed loss (times the divisor of the loss its step
differentiated), the maximum kept, and divided by the window's total weight at the
update: the large batch's measurement, whatever the micro-batches weigh.

    >>> import keras
    >>> scale = keras.Variable(1.0, trainable=True)
    >>> scale.overwrite_with_gradient = True
    >>> flags((scale, keras.Variable(0.0)))
    (True, False)
    >>> [float(v) for v in maxima([2.0], [1.0], first=False)]
    [2.0]
"""

from __future__ import annotations

import keras

ops = keras.ops


def flags(variables) -> tuple[bool, ...]:
    """Whether each variable is overwritten with its gradient, in order."""
    return tuple(bool(getattr(v, "overwrite_with_gradient", False)) for v in variables)


def any_of(variables) -> bool:
    """Whether a variable among `variables` is overwritten with its gradient."""
    return any(flags(variables))


def ordinary(gradients, overwrites) -> list:
    """The gradients that are gradients: `None` where the variable is overwritten
    (what the screen and the sums see)."""
    if not any(overwrites):
        return list(gradients)
    return [None if flag else g for g, flag in zip(gradients, overwrites, strict=False)]


def values(gradients, overwrites) -> list:
    """The overwrite values: the gradient where the variable is overwritten, else
    `None`."""
    return [g if flag else None for g, flag in zip(gradients, overwrites, strict=False)]


def kinds(variables) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """`(flags, measured)` of `variables` for a window record (`Record.overwrites`,
    `Record.measured`): both empty where no variable is overwritten."""
    found = flags(variables)
    return (found, measured(variables)) if any(found) else ((), ())


def measured(variables) -> tuple[bool, ...]:
    """Whether each variable is a float8 layer's output-gradient amax history, whose
    newest entry (index 0, where Keras's `compute_float8_amax_history` writes it)
    measures the gradient flowing back: a value in the units of the loss the step
    differentiated, which the window converts to the whole window's."""
    return tuple(bool(getattr(v, "overwrite_with_gradient", False))
                 and getattr(v, "name", "") == "outputs_grad_amax_history"
                 and len(getattr(v, "shape", ())) == 1
                 for v in variables)


def in_units(value, factor):
    """`value` (an output-gradient amax history) with its newest entry times
    `factor`: a micro-batch's measurement in the units of the window's summed loss
    (`factor` the micro-batch's loss divisor), or back (`1 / W`)."""
    value = ops.convert_to_tensor(value)
    newest = ops.cast(ops.arange(value.shape[0]) == 0, value.dtype)
    factor = ops.cast(factor, value.dtype)
    return value * (1.0 + newest * (factor - 1.0))


def maxima(kept, new, first) -> list:
    """A window's overwrite values after one more accepted micro-batch: its `new`
    value where the window held none (`first`), else the elementwise maximum with the
    `kept` one (Keras's own accumulation keeps the maximum, against a zero start).
    Entries where `new` is None stay `kept`."""
    result = []
    for old, value in zip(kept, new, strict=True):
        if value is None:
            result.append(old)
            continue
        value = ops.cast(value, ops.convert_to_tensor(old).dtype)
        result.append(ops.where(first, value, ops.maximum(old, value)))
    return result


def names(variables) -> list:
    """The paths (names) of the overwritten variables among `variables`."""
    return [getattr(v, "path", None) or v.name for v, flag in zip(variables, flags(variables))
            if flag]


# What gradaccum knows of a variable's rule -------------------------------------------------

#: The `overwrite_with_gradient` variables of a Keras layer in float8 mode, whose
#: values the window's maximum gives exactly.
FLOAT8 = ("inputs_scale", "inputs_amax_history", "kernel_scale", "kernel_amax_history",
          "outputs_grad_scale", "outputs_grad_amax_history")
#: Those of them that measure the gradient flowing back (their values are in the
#: units of the loss the step differentiates).
GRADIENT_MEASURED = ("outputs_grad_scale", "outputs_grad_amax_history")


def float8_roles(model) -> dict:
    """`id(variable) -> role` for the float8 variables of `model`'s layers in float8
    mode (`FLOAT8`'s names)."""
    roles = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if getattr(layer, "quantization_mode", None) != "float8":
            continue
        for role in FLOAT8:
            variable = getattr(layer, role, None)
            if variable is not None:
                roles[id(variable)] = role
    return roles


def unknown_rules(model, variables) -> list:
    """The paths of the `overwrite_with_gradient` variables among `variables` that
    are not a float8 layer's: a user's, whose rule gradaccum takes to be Keras's
    (the window's maximum) without knowing it."""
    roles = float8_roles(model)
    return [name for v, name in zip(_marked(variables), names(variables))
            if id(v) not in roles]


def gradient_measured(model, variables) -> list:
    """The paths of the float8 variables among `variables` that measure the
    gradient flowing back (`GRADIENT_MEASURED`)."""
    roles = float8_roles(model)
    return [name for v, name in zip(_marked(variables), names(variables))
            if roles.get(id(v)) in GRADIENT_MEASURED]


def _marked(variables) -> list:
    return [v for v, flag in zip(variables, flags(variables)) if flag]


def privacy_message(marked) -> str:
    """`privacy` refused with `overwrite_with_gradient` variables."""
    return (
        "`privacy` cannot train a model with `overwrite_with_gradient` variables "
        "(float8's scales and amax histories): their values come from the whole "
        "micro-batch, not from one example's clipped gradient, and would leak it. "
        f"Received: {_listed(marked)}. Train in float32 or bfloat16 with `privacy`, "
        "or without `privacy` in float8."
    )


def own_step_message(measured) -> str:
    """A model's own `train_step` with float8's output-gradient variables."""
    return (
        "This model's own `train_step` differentiates its own loss, so float8 "
        f"quantizes each micro-batch's gradient of that loss ({_listed(measured)} "
        "scale it), larger than the window's by the window's weight over the "
        "micro-batch's: the largest values saturate float8's range where one step on "
        "the whole window would not, and the weights follow a float8 training close "
        "to, not exactly, the large batch's (the amax histories record the window's, "
        "assuming a loss averaged over the micro-batch). For the large batch's, let "
        "Keras's default `train_step` run (override `compute_loss` instead)."
    )


def unknown_rule_message(unknown) -> str:
    """`overwrite_with_gradient` variables gradaccum does not know the rule of."""
    return (
        f"gradaccum keeps the window's elementwise maximum of the values of "
        f"{_listed(unknown)} (`overwrite_with_gradient` variables that are not a "
        "float8 layer's), Keras's own accumulation rule for such variables, and "
        "hands it to the optimizer once per window. Where a value is not a maximum "
        "of the micro-batches' (a count, a mean), the window's is not what one step "
        "on the whole window would give it: compute it from the window yourself."
    )


def unequal_message(*, short_end: bool = False, budget: bool = False,
                    weights: bool = True, skips: bool = False) -> str:
    """Warned once at `fit` where a window of a float8 model was differentiated over
    another weight than it ended with (`transitions.micro_batch` and `close` flag
    it), naming the causes, the one the fit saw first: a partial window flushed
    where the data ended before the step knew it would (`short_end`); a weight
    `budget` not met exactly; then those the settings allow: micro-batches of
    different `weights`, a micro-batch skipped after an accepted one (`skips`: the
    fit skipped one)."""
    causes = []
    if short_end:
        causes.append(
            "ended with a partial window flushed where the data ended before the "
            "epoch's length or at an end `fit` did not know (a generator, a "
            "`tf.data` pipeline of unknown cardinality): its micro-batches were "
            "divided by the full window's weight. Give `fit` data of a known length "
            "that reaches it (arrays, or `steps_per_epoch` the data can fill), or use "
            "`partial=\"drop\"`")
    if budget:
        causes.append(
            "did not weigh exactly `weight_per_update` (a budget passed by the "
            "micro-batch that reached it, or a last window short of it): micro-batch "
            "weights that divide the budget make it exact")
    if weights or not (causes or skips):
        causes.append(
            "held micro-batches of different weights (sizes, or unmasked elements): "
            "equal micro-batches (batch sizes that divide the data, no masks varying "
            "between micro-batches) make it exact")
    if skips:
        causes.append(
            "skipped a micro-batch (not finite) after accepting one, whose loss was "
            "divided by a weight that counted the skipped one")
    return (
        "A window of this float8 model " + "; or ".join(causes) + ". Each "
        "micro-batch's loss was divided by the window's weight as expected when it "
        "ran, so float8 quantized its gradient at another size than one step on the "
        "whole window does. The weights, and the output-gradient amax histories of "
        "all but the layer nearest the loss, are close to, not exactly, the large "
        "batch's."
    )


def _listed(paths, limit: int = 6) -> str:
    shown = ", ".join(repr(p) for p in paths[:limit])
    more = len(paths) - limit
    return f"variable(s) {shown}" + (f" and {more} more" if more > 0 else "")


def rules(model) -> list:
    """What the window does with `model`'s `overwrite_with_gradient` variables, in
    words (the audit names it): one line per float8 layer, one per other variable."""
    variables = model.trainable_variables
    roles = float8_roles(model)
    lines = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if getattr(layer, "quantization_mode", None) != "float8":
            continue
        owned = [v for v in _marked(variables) if id(v) in roles
                 and any(v is getattr(layer, role, None) for role in FLOAT8)]
        if owned:
            lines.append(
                f"float8 layer {layer.name!r}: its {len(owned)} scales and amax histories "
                "are not gradients: the window keeps the elementwise maximum of its "
                "micro-batches' values (the amax of the whole window, as one step on it "
                "measures), applied once; their rows compare those values.")
    for name in unknown_rules(model, variables):
        lines.append(
            f"variable {name!r} (overwrite_with_gradient): the window keeps the "
            "elementwise maximum of its micro-batches' values, Keras's rule, which "
            "gradaccum cannot check is this variable's; its row compares those values.")
    return lines
