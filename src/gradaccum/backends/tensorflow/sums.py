"""The window's sums on TensorFlow: add a micro-batch in place, combine a window.

A window of micro-batches ``i`` with gradients ``g_i`` and weights ``w_i`` becomes one
update with the combined gradient

    G = sum_i w_i g_i / sum_i w_i      (reduction "mean")
    G = sum_i g_i                      (reduction "sum")

`combine` is `gradaccum.core.combine`'s (the one place the formula is written);
`add_micro_batch` adds in place to TensorFlow variables, sparse gradients included;
`deduplicated` sums a sparse gradient's repeated rows before an optimizer sees it.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.combine import REDUCTIONS, combine  # noqa: F401 (re-exported)


def add_micro_batch(accumulators, gradients, factor=None) -> None:
    """Adds `factor * g` (or `g` when `factor` is None) to each accumulator.

    A `None` gradient leaves its accumulator as it was; a `tf.IndexedSlices` is
    scatter-added, never densified.
    """
    for grad, acc in zip(gradients, accumulators):
        if grad is None:
            continue
        scale = None if factor is None else tf.cast(factor, acc.dtype)
        if isinstance(grad, tf.IndexedSlices):
            values = tf.cast(grad.values, acc.dtype)
            if scale is not None:
                values = values * scale
            replica_local(acc).scatter_add(
                tf.IndexedSlices(values, grad.indices, grad.dense_shape)
            )
        else:
            grad = tf.cast(grad, acc.dtype)
            if scale is not None:
                grad = grad * scale
            acc.assign_add(grad)


def replica_local(variable):
    """The variable a replica adds to: under a tf.distribute strategy an
    accumulator is replica-local (synchronized on read), and such a variable
    refuses `scatter_add`; its own replica's copy takes it."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable._get_on_device_or_primary()
    return variable


def deduplicated(gradient):
    """A `tf.IndexedSlices` with each row once, its pieces summed (kept sparse);
    anything else as it is.

    Keras's optimizers on TensorFlow apply their element-wise math (Adam's and
    RMSprop's squares, Adagrad's) to the pieces of a sparse gradient before they are
    summed, so a row an embedding lookup hit several times in a batch gets the sum
    of squares where the gradient's math has the square of the sum. Summed first,
    every optimizer receives the gradient itself.
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)
