"""`w_i`, the weight of one micro-batch inside a TensorFlow training step: 1
(`weighting="uniform"`), the user's callable, or (`"exact"`) the normalizer the
compiled loss divided by, which the loss recorded while the step computed it."""

from __future__ import annotations

import tensorflow as tf

from gradaccum import _fit_common
from gradaccum.weighting import NEGATIVE_WEIGHT, callable_weight


def micro_batch_weight(accumulation, x, y, sample_weight, exact_step: bool):
    """`w_i` of the micro-batch `(x, y, sample_weight)`: 1 (uniform), the user's
    callable, the compiled loss's normalizer when the step computed it (exact), else
    the micro-batch's size. `exact_step`: gradaccum's own step computed the loss
    (a missing normalizer is then worth a warning)."""
    weighting = accumulation.options.weighting
    if weighting == "uniform":
        return tf.constant(1.0)
    if callable(weighting):
        weight = callable_weight(weighting, x, y, sample_weight)
        check = tf.debugging.assert_greater_equal(weight, 0.0, message=NEGATIVE_WEIGHT)
        with tf.control_dependencies([check] if check is not None else []):
            return tf.identity(weight)
    normalizers = accumulation.normalizers.take()
    if not normalizers:
        if exact_step:
            _fit_common.warn_no_compiled_loss()
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        return tf.cast(tf.shape(first)[0], tf.float32)
    if len(normalizers) > 1 and exact_step:
        _track_term_ratios(accumulation.state, normalizers)
    return normalizers[0]


def _track_term_ratios(state, normalizers) -> None:
    """Several loss terms weigh a window exactly with one weight only when their
    normalizers keep the same ratios across it: a window where they differ marks the
    fit inexact (warned at the epoch's end)."""
    ratios = tf.stack([tf.math.divide_no_nan(n, normalizers[0]) for n in normalizers[1:]])
    first_in_window = state.accumulator.micro_step == 0
    differs = tf.reduce_any(
        tf.abs(ratios - state.term_ratios) > 1e-6 * tf.abs(state.term_ratios)
    )
    state.inexact.assign(
        tf.logical_or(state.inexact, tf.logical_and(~first_in_window, differs))
    )
    state.term_ratios.assign(tf.where(first_in_window, ratios, state.term_ratios))
