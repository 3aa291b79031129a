"""The combination math: add a micro-batch, combine a window.

A window of micro-batches ``i`` with gradients ``g_i`` and weights ``w_i`` becomes one
update with the combined gradient

    G = sum_i w_i g_i / sum_i w_i      (reduction "mean")
    G = sum_i g_i                      (reduction "sum")

`combine` is `gradaccum.core.combine`'s (the one place the formula is written);
`add_micro_batch` adds in place to TensorFlow variables, sparse gradients included.
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
            acc.scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
        else:
            grad = tf.cast(grad, acc.dtype)
            if scale is not None:
                grad = grad * scale
            acc.assign_add(grad)
