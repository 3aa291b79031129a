"""gradaccum's own training step on TensorFlow, for a model that uses Keras's
default `train_step`: forward, the model's own loss (`compute_loss`, compiled loss,
regularizers), backward of the loss weighted by the micro-batch's `w_i`, accumulation,
and an update when the window closes."""

from __future__ import annotations

import keras
import tensorflow as tf

from gradaccum.backends.tensorflow import batch_norm, following, privacy
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import logs as _logs
from gradaccum.core import fit_logs
from gradaccum.core import transitions as tr


def exact_step(accumulation, data):
    """One micro-batch, and an update when the window is due. Returns the step's
    metrics, as Keras's `train_step` does."""
    host, state = accumulation.host, accumulation.state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    acc = state.accumulator
    # A window of one micro-batch on one device: G = w g / w = g, applied without
    # the accumulators' copy.
    single = accumulation.options.window.constant == 1 and not (
        accumulation.options.privacy is not None
        or tf.distribute.has_strategy()
        or kc.is_loss_scale_optimizer(host.optimizer)
        or acc.batch_normalization_layers
    )
    state.epoch_step.assign_add(1)
    y_pred, loss, weight, accepted = micro_batch(
        accumulation, x, y, sample_weight, single=single,
        end=tr.end_of_data(accumulation.fit_record()),
    )

    def update():
        kc.loss_tracker(host).update_state(
            loss, sample_weight=fit_logs.logged_weight(accumulation.policy, x, weight))
        return host.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return _logs.tracked(accumulation, update, lambda: accepted)


def micro_batch(accumulation, x, y, sample_weight, single=False, end=None, closes=True,
                length=None):
    """Forward, the host's loss and backward of one micro-batch, through the window
    (closed when due, or at the end of the data `end`, where `closes`; applied at
    once when `single`). `length`: the window's length in micro-batches of this
    one's size, where the caller knows it (split mode). Returns the predictions,
    the loss (as the loss tracker takes it), the micro-batch's weight and whether
    it was accepted."""
    host = accumulation.host
    acc = accumulation.state.accumulator
    optimizer = host.optimizer if closes else None
    record = acc._record(optimizer, direct=single)
    if accumulation.options.privacy is not None:
        return _private_micro_batch(accumulation, record, x, y, sample_weight, optimizer, end)
    policy = accumulation.policy
    variables = list(acc.target_variables)
    accumulation.normalizers.take()
    loss_scaled = kc.is_loss_scale_optimizer(host.optimizer)
    # With reduction "mean", differentiate w_i * L_i: the weight is applied once to
    # the loss rather than to every gradient. Under tf.distribute, L_i is the
    # replica's own loss (Keras divides it by the replica count: undone here), so
    # that the reduced sums give the global window's gradient exactly; with
    # reduction "sum" the replicas' gradients are summed, as Keras's optimizer does.
    # Under loss scaling the weight is applied with the unscaling instead, so that
    # the scaled loss is what Keras would scale (no extra overflows).
    mean = policy.mean
    weigh_loss = mean and not (single or loss_scaled)
    start = following.begin(accumulation)
    with (tf.GradientTape() as tape, batch_norm.driving(acc.batch_normalization_layers),
          accumulation.follower.observing()):
        if kc.call_has_training_arg(host):
            y_pred = host(x, training=True)
        else:
            y_pred = host(x)
        loss = kc.compute_loss(host, x, y, y_pred, sample_weight)
        normalizers = accumulation.normalizers.take()
        weight = tf.stop_gradient(tr.weigh(policy, x, y, sample_weight, normalizers, record))
        tr.track_terms(accumulation.fit_record(), record, normalizers)
        # The replica's own loss (Keras's divided by the replica count).
        replica_loss = kc.unscale_loss_for_distribution(loss)
        objective = replica_loss if mean else loss
        # (With float8 layers, the loss the large batch differentiates: the gradient
        # float8 measures and quantizes is the large batch's.)
        factor, unit = tr.loss_factor(
            policy, record, weight, weighted=weigh_loss, direct=single, length=length,
            fit=accumulation.fit_record(),
            replicas=tf.distribute.get_strategy().num_replicas_in_sync)
        if factor is not None:
            objective = objective * tf.cast(factor, loss.dtype)
        # Loss scaling (a LossScaleOptimizer's dynamic scale, or an optimizer's
        # static `loss_scale_factor`), as Keras's own train step does.
        objective = host.optimizer.scale_loss(objective)
    gradients = tape.gradient(objective, variables)
    acc._run(
        gradients, weight, weighted=weigh_loss or not mean,
        loss_scale_optimizer=host.optimizer if loss_scaled else None,
        optimizer=optimizer, policy=policy, end=end, fit=accumulation.fit_record(),
        direct=single, record=record, unit=unit, samples=tr.samples(x),
    )
    following.end(accumulation, start, record.outcome)
    return y_pred, replica_loss, weight, record.outcome.accepted


def _private_micro_batch(accumulation, record, x, y, sample_weight, optimizer, end):
    """`micro_batch` with `gradaccum.Privacy`: the sum of the examples' clipped
    gradients, weighted by the number of examples (the window's noise is added when it
    is applied). The loss logged is the micro-batch's, as Keras computes it."""
    host = accumulation.host
    acc = accumulation.state.accumulator
    start = following.begin(accumulation)
    with accumulation.follower.observing():
        y_pred, gradients, examples = privacy.clipped_micro_batch(
            accumulation, x, y, sample_weight
        )
    weight = tf.cast(examples, acc.total_weight.dtype)
    acc._run(gradients, weight, weighted=True, optimizer=optimizer,
             policy=accumulation.policy, end=end, fit=accumulation.fit_record(),
             record=record)
    following.end(accumulation, start, record.outcome)
    loss = kc.compute_loss(host, x, y, y_pred, sample_weight)
    return (y_pred, kc.unscale_loss_for_distribution(loss), weight,
            record.outcome.accepted)
