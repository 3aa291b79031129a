"""Argument checks of `GradientAccumulator` on TensorFlow (the fixed error form of
`gradaccum.core.validation`, for TensorFlow's dtypes and tensors)."""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.validation import (
    accumulator_dtype_name,
    check_weight_value,
    variable_name,
)


def check_accumulator_dtype(accumulator_dtype):
    """Returns the accumulator dtype as a `tf.DType`, or raises the fixed-form
    ValueError."""
    return tf.as_dtype(accumulator_dtype_name(accumulator_dtype))


def check_gradients(gradients, variables) -> list:
    """One gradient (tensor, IndexedSlices or None) per variable, of its shape."""
    gradients = list(gradients)
    if len(gradients) != len(variables):
        raise ValueError(
            f"`gradients` must have one entry per variable ({len(variables)}). "
            f"Received: {len(gradients)} gradients."
        )
    checked = []
    for grad, var in zip(gradients, variables):
        if grad is not None and not isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        if grad is not None:
            sparse = isinstance(grad, tf.IndexedSlices)
            shape = grad.values.shape if sparse else grad.shape
            # IndexedSlices hold rows: only the trailing dimensions must match.
            if not tf.TensorShape(shape[1:] if sparse else shape).is_compatible_with(
                var.shape[1:] if sparse else var.shape
            ):
                raise ValueError(
                    f"The gradient of variable '{variable_name(var)}' must have "
                    f"shape {tuple(var.shape)}. Received: shape={tuple(shape)}"
                )
        checked.append(grad)
    return checked


def check_weight(weight, dtype):
    """A micro-batch weight as a scalar tensor of `dtype`: checked now when it is
    concrete (finite, >= 0, scalar), by shape when it is symbolic."""
    if isinstance(weight, tf.Tensor) and not tf.executing_eagerly():
        if weight.shape.rank not in (None, 0) and weight.shape.num_elements() != 1:
            raise ValueError(
                "`weight` must be a scalar. "
                f"Received: weight with shape {tuple(weight.shape)}"
            )
    else:
        check_weight_value(weight.numpy() if hasattr(weight, "numpy") else weight)
    return tf.reshape(tf.cast(weight, dtype), ())
