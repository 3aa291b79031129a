"""Loss scaling through a window: a `LossScaleOptimizer`'s scale reacts to each
micro-batch as Keras's reacts to each step (halved on an overflow, doubled after
`growth_steps` finite steps in a row), and the factor that unscales a micro-batch's
gradient."""

from __future__ import annotations

import keras

ops = keras.ops


def _where(condition, new, old):
    return ops.where(condition, ops.cast(new, old.dtype), old)


def react(record, accepted, growth_steps: int, grows: bool = True):
    """Loss scaling's reaction to one micro-batch (when the record reacts at once):
    the scale halves on an overflow, and (where `grows`: else the caller counts
    the finite steps, once per batch in split mode on JAX, as Keras counts them)
    grows after `growth_steps` accepted micro-batches in a row, as Keras's
    LossScaleOptimizer counts its steps. Returns the factor that unscales the
    micro-batch's gradient (1 / the scale it was computed with)."""
    counter, scale = record.loss_scale()
    factor = 1.0 / ops.cast(scale, "float32")
    if record.reacts_now:
        if grows:
            counter, scale = reacted(counter, scale, accepted, growth_steps)
        else:
            backed = backed_off(counter, scale)
            counter = _where(accepted, counter, backed[0])
            scale = _where(accepted, scale, backed[1])
        record.set_loss_scale(counter, scale)
    return factor


def reacted(counter, scale, accepted, growth_steps: int):
    """`(counter, scale)` after one step: grown by one finite step where
    `accepted`, backed off where not."""
    grown = grown_by(counter, scale, 1, growth_steps)
    backed = backed_off(counter, scale)
    return _where(accepted, grown[0], backed[0]), _where(accepted, grown[1], backed[1])


def grown_by(counter, scale, steps, growth_steps: int):
    """`(counter, scale)` after `steps` finite steps: the scale doubles each time the
    count of finite steps in a row reaches `growth_steps`."""
    total = ops.cast(counter, "int32") + ops.cast(steps, "int32")
    doublings = total // growth_steps
    scale = scale * ops.cast(ops.power(2.0, ops.cast(doublings, "float32")), scale.dtype)
    return ops.cast(total % growth_steps, counter.dtype), scale


def backed_off(counter, scale):
    """`(counter, scale)` after a step with a non-finite gradient."""
    return ops.zeros_like(counter), scale * ops.cast(0.5, scale.dtype)
