"""The non-finite screen on TensorFlow: whether a micro-batch's gradients are all
finite, at the cost of one sum per gradient on the usual path. The policy itself
(`nonfinite`) is `gradaccum.core.screening`'s, applied by the state machine
(`gradaccum.core.transitions.screen`)."""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.screening import RAISE_WORDS  # noqa: F401 (re-exported)
from gradaccum.core.validation import NONFINITE, check_nonfinite  # noqa: F401 (re-exported)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def all_finite(gradients):
    """Whether every gradient is finite, as a boolean scalar tensor.

    One sum per gradient decides in the usual case (an inf or a nan makes its sum
    non-finite). A sum that is not finite may also come from a finite gradient whose
    float32 sum overflows: only then does an element-wise check decide, so the screen
    costs one pass and reports no false positive. (A lowered `tf.cond`: the usual path
    runs no function call; the element-wise branch's few nodes are walked as dead.)
    """
    if not any(g is not None for g in gradients):
        return tf.constant(True)
    return tf.cond(sums_finite(gradients), lambda: tf.constant(True),
                   lambda: elementwise_finite(gradients))


def squared_norm(gradients):
    """The squared norm of all of `gradients` together, a float32 scalar. A sparse
    gradient's rows of one index are added first (its dense form's norm), without
    making the dense form."""
    total = tf.constant(0.0)
    for g in gradients:
        if g is None:
            continue
        values = tf.cast(_values(g), tf.float32)
        if isinstance(g, tf.IndexedSlices):
            unique, position = tf.unique(g.indices)
            values = tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0])
        total += tf.reduce_sum(tf.square(values))
    return total


def finite_and_norm(gradients):
    """`(all_finite, squared_norm)` in one pass: the squared norm's sum decides the
    screen as `all_finite`'s sums do (not finite: an inf or a nan, or squares of
    finite values that overflowed, which the element-wise check tells apart)."""
    squared = squared_norm(gradients)
    if not any(g is not None for g in gradients):
        return tf.constant(True), squared
    finite = tf.cond(tf.math.is_finite(squared), lambda: tf.constant(True),
                     lambda: elementwise_finite(gradients))
    return finite, squared


def sums_finite(gradients):
    """Whether the sum of every gradient's elements is finite (a boolean scalar): True
    says every gradient is finite; False says one is not, or a float32 sum of finite
    values overflowed (`elementwise_finite` decides then)."""
    sums = [tf.reduce_sum(tf.cast(_values(g), tf.float32)) for g in gradients
            if g is not None]
    if not sums:
        return tf.constant(True)
    return tf.math.is_finite(tf.add_n(sums))


def elementwise_finite(gradients):
    """Whether every element of every gradient is finite (a boolean scalar)."""
    values = [_values(g) for g in gradients if g is not None]
    if not values:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


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
