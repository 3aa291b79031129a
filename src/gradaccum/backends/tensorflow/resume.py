"""Resuming inside an epoch on TensorFlow: after `BackupAndRestore` restored a
position inside an epoch, the epoch restarts from its first batch, and the
micro-batches already trained on are skipped (counted, not trained)."""

from __future__ import annotations

import tensorflow as tf

from gradaccum.backends.tensorflow import logs as _logs


def skips_outside_the_step(accumulation) -> bool:
    """Under several replicas the micro-batches a restored fit already trained on are
    skipped outside the compiled step: there the step's replicas meet (merge_call),
    which they cannot do inside a `tf.cond`."""
    return accumulation.resumable and accumulation.replicas() > 1


def skipping_step(accumulation, step, data):
    """`step(data)` with its logs, or (while restored micro-batches are still to be
    skipped) a count and logs of the same structure. The training branch is traced
    first: the skipping branch reports logs of its structure."""
    spec = []

    def train():
        logs = _logs.with_counters(accumulation, step(data))
        spec.append(tf.nest.map_structure(tf.convert_to_tensor, logs))
        return logs

    def skip():
        state = accumulation.state
        state.resume_skip.assign_sub(1)
        state.epoch_step.assign_add(1)
        if accumulation.own_train_step is None:
            return _logs.with_counters(accumulation, accumulation.host.get_metrics_result())
        return tf.nest.map_structure(lambda t: tf.zeros_like(t), spec[0])

    return tf.cond(accumulation.state.resume_skip <= 0, train, skip)


def skipping_restored(accumulation, function):
    """`function` (the train function), except while micro-batches restored by
    BackupAndRestore are still to be skipped: then a call takes the next batch from
    the iterator and drops it (Keras's multi-step function fails under several
    replicas, so a call is one batch)."""
    state = accumulation.state

    def train_function(iterator):
        if int(state.resume_skip.numpy()) <= 0:
            return function(iterator)
        next(iterator)
        state.resume_skip.assign(state.resume_skip - 1)
        state.epoch_step.assign(state.epoch_step + 1)
        return _logs.with_counters(accumulation, accumulation.host.get_metrics_result())

    train_function.gradaccum_skips = True
    train_function.gradaccum_wrapped = getattr(function, "gradaccum_wrapped", False)
    return train_function
