"""Split mode's training step on TensorFlow: one batch cut into micro-batches
(`micro_batch_size`, see `split.py`), their gradients combined exactly and applied
once. The batch is the window."""

from __future__ import annotations

import keras
import tensorflow as tf

from gradaccum.backends.tensorflow import following, step
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import logs as _logs
from gradaccum.backends.tensorflow import split as _split
from gradaccum.core import fit_logs


def split_step(accumulation, data):
    """One batch: its micro-batches through gradaccum's exact step or the model's
    own step, then one update per accumulator. Returns the batch's logs."""
    state = accumulation.state
    own_step = accumulation.own_train_step
    state.epoch_step.assign_add(1)
    size = _size_in_step(accumulation)
    if own_step is None:
        host = accumulation.host
        batch = _split.batch_size(data)

        def micro_batch(micro, weighted, weights):
            return _exact_micro_batch(accumulation, micro, weighted, weights, batch, size)

        if accumulation.micro_batch_jit:
            # XLA compiles each micro-batch; the loop around it stays outside, so a
            # smaller last micro-batch is one more compiled shape.
            micro_batch = tf.function(micro_batch, jit_compile=True, autograph=False)
        zero = tf.constant(0.0)
        weighted, weights = _split.for_each(data, size, micro_batch, (zero, zero))
        after = [weighted, weights]
        # The batch's loss, logged as Keras logs a batch's: weighted by its size.
        # (Where skips leave the trackers, a batch whose every micro-batch was
        # skipped weighs nothing.)
        batch_weight = tf.cast(_split.batch_size(data), tf.float32)
        if fit_logs.tracks_skips(accumulation.policy, kc.is_loss_scale_optimizer(host.optimizer)):
            batch_weight = tf.where(weights > 0, batch_weight, 0.0)
        kc.loss_tracker(host).update_state(tf.math.divide_no_nan(weighted, weights),
                                           sample_weight=batch_weight)
        logs = host.get_metrics_result()
        pairs = [(state.accumulator, host.optimizer)]
    else:
        logs = _split.fold(
            data, size, lambda micro: accumulation.own_step.run(own_step, micro)
        )
        after = tf.nest.flatten(logs)
        pairs = list(state.own)
    if accumulation.options.auto:
        # Ops on different variables are not ordered by themselves: the flag follows
        # the micro-batches, and the update follows the flag.
        with tf.control_dependencies(after):
            after = [tf.convert_to_tensor(state.applying.assign(True))]
    with tf.control_dependencies(after):
        applied = [acc.close(optimizer, True, True, fit=accumulation.fit_record())
                   for acc, optimizer in pairs]
    if applied:
        # The batch's moving statistics move once, with its update.
        following.settle(accumulation, applied[0])
    return logs


def _exact_micro_batch(accumulation, micro, weighted, weights, batch, size):
    """One micro-batch of a split batch (of `batch` samples cut into micro-batches of
    `size`, the last one maybe smaller); adds its weighted loss and weight to the
    batch's."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro)
    # The batch's length in micro-batches of the split's size: the window's last
    # micro-batch, however small, then expects only its own weight still to come.
    length = tf.cast(batch, tf.float32) / tf.cast(size, tf.float32)
    y_pred, loss, weight, accepted = step.micro_batch(
        accumulation, x, y, sample_weight, closes=False, length=length
    )
    _logs.tracked(accumulation, lambda: accumulation.host.compute_metrics(
        x, y, y_pred, sample_weight=sample_weight), lambda: accepted)
    # The batch's loss weighs each micro-batch as the loss tracker would.
    weight = tf.cast(fit_logs.logged_weight(accumulation.policy, x, weight), tf.float32)
    if fit_logs.tracks_skips(accumulation.policy,
                       kc.is_loss_scale_optimizer(accumulation.host.optimizer)):
        # A skipped micro-batch's loss joins nothing.
        loss = tf.where(accepted, tf.cast(loss, tf.float32), 0.0)
        weight = tf.where(accepted, weight, 0.0)
    return weighted + tf.cast(loss, tf.float32) * weight, weights + weight


def _size_in_step(accumulation):
    if accumulation.options.auto:
        # "auto" changes the size between calls without a retrace.
        return tf.cast(accumulation.state.micro_batch_size, tf.int32)
    return tf.constant(accumulation.options.micro_batch_size, tf.int32)
