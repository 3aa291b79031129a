"""The combination math: add a micro-batch, combine a window.

A window of micro-batches ``i`` with gradients ``g_i`` and weights ``w_i`` becomes one
update with the combined gradient

    G = sum_i w_i g_i / sum_i w_i      (reduction "mean")
    G = sum_i g_i                      (reduction "sum")

These functions are the one place the formula is written, with `keras.ops`: the
TensorFlow accumulator (which adds sparse gradients in place), its cross-replica
update and the JAX step all call them.
"""

from __future__ import annotations

import keras

REDUCTIONS = ("mean", "sum")


def added(sums, gradients, factor=None) -> list:
    """The sums after a micro-batch: `sum + factor * g` (or `sum + g` when `factor` is
    None) per variable, in each sum's dtype; a `None` gradient leaves its sum."""
    ops = keras.ops
    result = []
    for total, grad in zip(sums, gradients):
        if grad is None:
            result.append(total)
            continue
        grad = ops.cast(grad, total.dtype)
        if factor is not None:
            grad = grad * ops.cast(factor, total.dtype)
        result.append(total + grad)
    return result


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
    ops = keras.ops
    if reduction == "mean":
        scale = ops.divide_no_nan(ops.ones((), total_weight.dtype), total_weight)
    combined = []
    for grad, dtype in zip(sums, dtypes):
        if reduction == "mean":
            grad = grad * ops.cast(scale, grad.dtype)
        combined.append(ops.cast(grad, keras.backend.standardize_dtype(dtype)))
    return combined
