"""Screening micro-batches whose gradient is not finite, and loss-scale reactions.

`nonfinite` is a policy: one of three ready names or a callable, as optax's
`should_skip_update_fn`:

- `"skip"` (default): a micro-batch whose gradient holds an inf or a nan is dropped
  with its weight, counted, and warned about once;
- `"raise"`: such a micro-batch stops training with an error naming it;
- `"apply"`: every micro-batch is accumulated as it is (Keras's behaviour);
- a callable `gradients -> bool` (a Python or tensor boolean): True skips the
  micro-batch, as `"skip"` does, without a warning.

Under a `LossScaleOptimizer` an overflowing micro-batch is always skipped and the
loss scale backs off, as Keras's own optimizer does: at once on one device, at the
update under a strategy (`settle_loss_scale`).
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum._validation import (  # noqa: F401 (re-exported)
    NONFINITE,
    check_callable_result,
    check_nonfinite,
)
from gradaccum.backends.tensorflow.keras_compat import back_off_loss_scale  # noqa: F401 (re-exported)
from gradaccum.core.screening import (  # noqa: F401 (re-exported)
    RAISE_WORDS,
    raise_message,
    warn_skipped,
)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def all_finite(gradients):
    """Whether every gradient is finite, as a boolean scalar tensor.

    One sum per gradient decides in the usual case (an inf or a nan makes its sum
    non-finite). A sum that is not finite may also come from a finite gradient whose
    float32 sum overflows: only then does an element-wise check decide, so the
    screen costs one pass and reports no false positive.
    """
    values = [_values(g) for g in gradients if g is not None]
    if not values:
        return tf.constant(True)
    sums = tf.stack([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values])

    def elementwise():
        return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))

    return tf.cond(
        tf.reduce_all(tf.math.is_finite(sums)), lambda: tf.constant(True), elementwise
    )


def user_skip(nonfinite, gradients):
    """Calls a user's `nonfinite` callable and checks that it gives a boolean scalar."""
    return check_callable_result(
        nonfinite(list(gradients)),
        "nonfinite",
        kind="a boolean (True: skip the micro-batch)",
        scalar="a scalar boolean",
        accepts=lambda dtype: dtype == "bool",
    )


def accept(nonfinite, gradients):
    """Whether a micro-batch is accumulated under `nonfinite`: a boolean tensor, or
    None when the policy never skips (`"apply"`). `"raise"` gives the finiteness;
    the caller raises."""
    if nonfinite == "apply":
        return None
    if callable(nonfinite):
        return tf.logical_not(user_skip(nonfinite, gradients))
    return all_finite(gradients)


def assert_finite(finite, micro_batch, position):
    """A graph assertion that raises nonfinite="raise"'s error when `finite` is False."""
    return tf.debugging.Assert(
        finite,
        [RAISE_WORDS[0], micro_batch, RAISE_WORDS[1], position, RAISE_WORDS[2]],
        summarize=1,
    )


def compiled_raise_message(skipped: int) -> str:
    """nonfinite="raise" under jit_compile: XLA drops the assertion, so fit raises
    after the compiled call."""
    return (
        f"gradaccum: a gradient is not finite (inf or nan) in {skipped} "
        "micro-batch(es) of this compiled call (jit_compile: the micro-batch "
        "was skipped, and the error is raised after the call): "
        "nonfinite=raise stops here. Check the data and the loss, or use "
        "nonfinite=skip to drop such micro-batches."
    )


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
        back_off_loss_scale(optimizer)
        return tf.constant(False)

    def grow():
        grow_loss_scale(optimizer, micro_batches)
        return tf.constant(True)

    tf.cond(overflowed, back_off, grow)
