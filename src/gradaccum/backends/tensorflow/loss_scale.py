"""Loss scaling (`keras.optimizers.LossScaleOptimizer`) under accumulation on
TensorFlow.

The accumulated gradients are unscaled as they come in (one multiply both unscales
and weighs). An overflowing micro-batch is always skipped and the loss scale backs
off, as Keras's own optimizer does: at once on one device, once per window under a
strategy, where the replicas learn of each other's overflows at the update
(`settle_loss_scale`). Finite micro-batches count as Keras's finite steps.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import screening


def check_loss_scale_optimizer(optimizer) -> None:
    """Raises unless `optimizer` is a LossScaleOptimizer."""
    if not kc.is_loss_scale_optimizer(optimizer):
        raise ValueError(
            "`loss_scale_optimizer` must be a keras.optimizers.LossScaleOptimizer. "
            f"Received: loss_scale_optimizer of type {type(optimizer).__name__}"
        )


def add(accumulator, gradients, weight, scale: bool, optimizer):
    """Adds a micro-batch whose loss `optimizer` scaled to `accumulator` (a
    `GradientAccumulator`), unscaled (and weighed when `scale`), or skips it if a
    gradient overflowed (or the `nonfinite` callable says so). Returns whether it was
    added (a boolean tensor)."""
    # Under a strategy the replicas learn of each other's overflows at the update
    # (its one reduction), where the scale reacts once for the window.
    react_now = not tf.distribute.has_strategy()

    def add_unscaled():
        factor = unscale_factor(optimizer, weight.dtype)
        accumulator._add_micro_batch(gradients, weight, weight * factor if scale else factor)
        if react_now:
            grow_loss_scale(optimizer)
        return tf.constant(True)

    def skip():
        # Under loss scaling an overflow is expected now and then: always skipped.
        screening.count_skip(accumulator)
        if react_now:
            kc.back_off_loss_scale(optimizer)
        return tf.constant(False)

    accumulator.state.micro_batches.assign_add(1)
    accepted = screening.all_finite(gradients)
    policy = accumulator.nonfinite
    if callable(policy):
        accepted = tf.logical_and(
            accepted, tf.logical_not(screening.user_skip(policy, gradients))
        )
    return tf.cond(accepted, add_unscaled, skip)


def unscale_factor(loss_scale_optimizer, dtype):
    """1 / the current loss scale."""
    return tf.math.reciprocal(tf.cast(loss_scale_optimizer.dynamic_scale, dtype))


def grow_loss_scale(optimizer, steps=1) -> None:
    """`steps` finite steps under loss scaling (a finite micro-batch on one device, a
    window's micro-batches under a strategy), counted as Keras's LossScaleOptimizer
    counts finite steps: after `dynamic_growth_steps` in a row the scale doubles."""
    growth = tf.cast(optimizer.dynamic_growth_steps, tf.int64)
    total = tf.cast(optimizer.step_counter, tf.int64) + tf.cast(steps, tf.int64)
    optimizer.step_counter.assign(tf.cast(total % growth, optimizer.step_counter.dtype))
    scale = optimizer.dynamic_scale
    doublings = tf.cast(total // growth, scale.dtype)
    scale.assign(scale * tf.pow(tf.constant(2.0, scale.dtype), doublings))


def settle_loss_scale(optimizer, overflowed, micro_batches) -> None:
    """The loss scale's one reaction to a window under a strategy (in cross-replica
    context, so every replica's copy changes alike): if any replica's share
    overflowed, it backs off once, as Keras's does for a step with a non-finite
    gradient; else the window's `micro_batches` count as that many finite steps."""

    def back_off():
        kc.back_off_loss_scale(optimizer)
        return tf.constant(False)

    def grow():
        grow_loss_scale(optimizer, micro_batches)
        return tf.constant(True)

    tf.cond(overflowed, back_off, grow)
