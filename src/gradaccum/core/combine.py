"""The combination math: a window's combined gradient.

A window of micro-batches ``i`` with gradients ``g_i`` and weights ``w_i`` becomes one
update with the combined gradient

    G = sum_i w_i g_i / sum_i w_i      (reduction "mean")
    G = sum_i g_i                      (reduction "sum")

`combine` is the one place the formula is written, with `keras.ops`: every backend's
window close (`gradaccum.core.transitions.combined`) calls it; each backend adds a
micro-batch to its sums its own way (TensorFlow in place, sparse rows
scatter-added; JAX with a `where`).
"""

from __future__ import annotations

import keras

REDUCTIONS = ("mean", "sum")


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
        # 1 / W in W's dtype (float64 sums keep float64: Keras's torch
        # `divide_no_nan` would compute it in float32), 0 for an empty window.
        held = total_weight > 0
        safe = ops.where(held, total_weight, ops.ones_like(total_weight))
        scale = ops.where(held, ops.reciprocal(safe), ops.zeros_like(total_weight))
    combined = []
    for grad, dtype in zip(sums, dtypes):
        if reduction == "mean":
            grad = grad * ops.cast(scale, grad.dtype)
        combined.append(ops.cast(grad, keras.backend.standardize_dtype(dtype)))
    return combined
