"""The combination math: add a micro-batch, combine a window.

A window of micro-batches ``i`` with gradients ``g_i`` and weights ``w_i`` becomes one
update with the combined gradient

    G = sum_i w_i g_i / sum_i w_i      (reduction "mean")
    G = sum_i g_i                      (reduction "sum")

These two functions are the only place the formula is written; the accumulator, the
fit integration and the cross-replica update all call them.
"""

from __future__ import annotations

import tensorflow as tf

REDUCTIONS = ("mean", "sum")


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


def combine(sums, total_weight, reduction: str, dtypes) -> list:
    """G from the window's weighted sums and their total weight.

    Args:
        sums: one tensor per variable, `sum_i w_i g_i` (reduction "mean") or
            `sum_i g_i` (reduction "sum").
        total_weight: `sum_i w_i`, a scalar tensor.
        reduction: `"mean"` or `"sum"`.
        dtypes: the variables' dtypes, which G is cast to.

    Returns:
        One tensor per variable. Under "mean" a total weight of 0 gives zeros.
    """
    if reduction == "mean":
        scale = tf.math.divide_no_nan(tf.constant(1, total_weight.dtype), total_weight)
    combined = []
    for grad, dtype in zip(sums, dtypes):
        if reduction == "mean":
            grad = grad * tf.cast(scale, grad.dtype)
        combined.append(tf.cast(grad, tf.as_dtype(dtype)))
    return combined
