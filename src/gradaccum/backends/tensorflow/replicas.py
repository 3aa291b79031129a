"""Closing a window under a tf.distribute strategy: every replica holds its share of
the window's sums; one reduction (`distributed.reduce_window`) gathers the sums, the
weights, the received counts, the skipped shares and the batch normalization windows,
and one optimizer update applies the global window on every replica.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum import batch_norm
from gradaccum._validation import check_optimizer
from gradaccum.backends.tensorflow import distributed as dist
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import loss_scale


def apply_if(accumulator, optimizer, condition):
    """`GradientAccumulator.apply_if` under a tf.distribute strategy: the replicas'
    windows reduced once, one update for all of them. Returns whether it updated."""
    strategy = tf.distribute.get_strategy()
    dist.distribution_of(accumulator.target_variables)
    condition = tf.cast(condition, tf.bool)
    # The window's length is the same on every replica (each replica sees a
    # share of every micro-batch), so all of them agree to reduce.
    if tf.distribute.in_cross_replica_context():
        # Outside `strategy.run` (e.g. closing a window at the end of the data).
        accumulator._prepare_optimizer(optimizer)
        due = tf.logical_and(condition, accumulator.window_length() > 0)
        window = strategy.run(lambda: _replica_window(accumulator))
        return _update_if(accumulator, strategy, optimizer, due, window)
    context = tf.distribute.get_replica_context()
    if not getattr(optimizer, "built", True):
        context.merge_call(lambda _: accumulator._prepare_optimizer(optimizer))
    check_optimizer(optimizer)
    due = tf.logical_and(condition, accumulator.window_length() > 0)
    # Replicas cannot synchronize inside a tf.cond of a replica function (keras
    # issue 20582), so they meet here on every call, which costs no
    # communication, and the condition is taken in cross-replica context.
    return context.merge_call(
        lambda strategy, *args: _update_if(accumulator, strategy, *args),
        args=(optimizer, due, _replica_window(accumulator)),
    )


def _replica_window(accumulator):
    """What a replica adds to the window's reduction besides its sums: how many
    of its shares were skipped (the loss scale's one reaction), and (with driven
    batch normalization layers) each layer's window statistics in this
    replica's slot."""
    state = accumulator.state
    dtype = state.total_weight.dtype
    window = [tf.cast(tf.reshape(state.window_skipped, [1]), dtype)]
    layers = accumulator.batch_normalization_layers
    if layers:
        context = tf.distribute.get_replica_context()
        replica, replicas = context.replica_id_in_sync_group, context.num_replicas_in_sync
        window.append(tf.concat(
            [layer._replica_slots(replica, replicas, dtype) for layer in layers], axis=0
        ))
    return window


def _update_if(accumulator, strategy, optimizer, due, window):
    return tf.cond(
        dist.first_local(strategy, due),
        lambda: _update(accumulator, strategy, optimizer, window),
        lambda: tf.constant(False),
    )


def _update(accumulator, strategy, optimizer, window):
    state = accumulator.state
    n = len(state.accumulators)
    reduced = dist.reduce_window(
        strategy, [*state.accumulators, state.total_weight, state.received, *window]
    )
    sums, (total_weight, received, skipped) = reduced[:n], reduced[n:n + 3]
    skipped = skipped[0]
    pooled = None
    if len(reduced) > n + 3:
        # Each driven batch normalization layer's replicas' windows, pooled.
        layers, replicas = accumulator.batch_normalization_layers, strategy.num_replicas_in_sync
        sizes = [layer._replica_slots_size(replicas) for layer in layers]
        pooled = [
            batch_norm.pool_replicas(gathered, replicas)
            for gathered in tf.split(reduced[n + 3], sizes)
        ]
    loss_scaling = accumulator._loss_scaling.value
    inner = optimizer
    if kc.is_loss_scale_optimizer(optimizer):
        loss_scaling, inner = optimizer, optimizer.inner_optimizer

    def update():
        with kc.applying_across_replicas(inner, strategy):
            accumulator._apply_combined(
                inner, accumulator._combine(accumulator._noised(sums), total_weight),
                received, total_weight,
                pooled,
            )
        return tf.constant(True)

    def close_empty():
        # Every share of the window was skipped: it closes without an update.
        accumulator.reset()
        return tf.constant(False)

    # Something to apply: a variable received a gradient in the window (read
    # from the summed counts, which a checkpoint restores exactly).
    accepted = tf.reduce_any(received > 0)
    micro_batches = accumulator.window_length()
    # Every replica's skipped shares, in the one count every replica keeps.
    state.skipped.assign(state.skipped + tf.cast(skipped, tf.int64))
    applied = tf.cond(accepted, update, close_empty)
    if loss_scaling is not None:
        # The scale the window's shares were scaled with reacts once (also when
        # the caller applies with the inner optimizer).
        with tf.control_dependencies([applied]):
            loss_scale.settle_loss_scale(loss_scaling, skipped > 0, micro_batches)
    return applied
