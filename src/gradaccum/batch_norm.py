"""Batch normalization whose moving statistics know about accumulation.

Keras's `BatchNormalization` updates its moving mean and variance on every forward
pass from that micro-batch's statistics: under accumulation that is k updates per
optimizer update, each from a small, noisy batch. `gradaccum.BatchNormalization`
normalizes with the micro-batch's own statistics too (as ghost batch norm), but
records them, pools the window's micro-batches exactly (window mean; window variance
including the spread between micro-batch means) and updates the moving statistics
once per optimizer update: what one large batch would have recorded.

The layer records only while an accumulator drives it (`wrap` does this; in a custom
loop, pass the model as `GradientAccumulator(..., layers=model)`); otherwise it
behaves exactly as Keras's layer.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from gradaccum import _keras_compat as kc
from gradaccum._keras_compat import Functional, flatten_layers

_REFUSED = {
    "renorm": "batch renormalization corrects every micro-batch with moving statistics "
    "that would change once per window",
}


def merge_moments(a, b):
    """Pools two groups given as (count, mean, sum of squared deviations).

    The parallel form of Welford's update (Chan et al.): exact for any split, with
    no cancellation between large raw moments. An empty group (count 0) is neutral.
    """
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    delta = mean_b - mean_a
    mean = mean_a + delta * tf.math.divide_no_nan(n_b, n)
    m2 = m2_a + m2_b + tf.square(delta) * tf.math.divide_no_nan(n_a * n_b, n)
    return n, mean, m2


def shifted_sums(count, mean, m2, shift):
    """(count, mean, m2) per channel as sums that add across groups: the count, the
    sum of deviations from `shift` and the sum of their squares, stacked flat.

    With a shift every replica shares (the moving mean), the replicas' groups pool
    exactly by summing, in one all-reduce; the shift keeps the squares small once
    the moving mean is near the data's."""
    deviation = mean - shift
    return tf.concat([count, count * deviation, m2 + count * tf.square(deviation)], axis=0)


def from_shifted_sums(sums, shift):
    """The pooled (count, mean, biased variance) of summed `shifted_sums`."""
    count, deviation, square = tf.split(sums, 3)
    mean_deviation = tf.math.divide_no_nan(deviation, count)
    variance = tf.math.divide_no_nan(square, count) - tf.square(mean_deviation)
    return count, shift + mean_deviation, tf.maximum(variance, 0.0)


def _check_options(config: dict, name: str) -> None:
    for option, why in _REFUSED.items():
        if config.get(option):
            raise ValueError(
                f"gradaccum.BatchNormalization cannot honour `{option}=True`: {why}. "
                f"Received: {option}=True (layer {name!r}). Use `{option}=False`, or "
                "keep Keras's BatchNormalization for this layer."
            )


@keras.saving.register_keras_serializable(package="gradaccum")
class BatchNormalization(keras.layers.BatchNormalization):
    """A drop-in for `keras.layers.BatchNormalization` under gradient accumulation.

    Takes Keras's arguments (any `axis`, inputs of rank 2 to 5, `center`, `scale`,
    initializers, regularizers, constraints, masks). In training, each micro-batch is
    normalized with its own statistics; when an accumulator drives the layer, the
    moving mean and variance are updated once per optimizer update, from the pooled
    statistics of the micro-batches of the window:

        moving = momentum * moving + (1 - momentum) * window statistic

    where the window variance is the biased variance of the concatenated window (as
    Keras records for one batch). A micro-batch skipped for a non-finite gradient is
    left out; a dropped partial window is forgotten.

    Under a strategy with several replicas each replica pools its own shares; at the
    update the replicas' windows are pooled in the accumulator's one reduction (as
    sums of deviations from the moving mean, which every replica shares), so the
    moving statistics move once, from the global window's statistics. With
    `synchronized=True` each micro-batch is normalized with the statistics of all
    replicas' shares (one all-reduce per micro-batch and layer, as Keras's
    synchronized layer needs too). The pending window is layer state
    (`window_count`, `window_mean`, `window_m2`, per channel), saved by `wrap`'s model
    with its accumulation state and by `tf.train.Checkpoint`; the layer's own weight
    entries are Keras's (gamma, beta, moving statistics), so weight files move
    between this layer and Keras's.

    Not driven by an accumulator (plain `fit`, inference), it is Keras's layer.
    `wrap` drives it only inside its own training step; a `GradientAccumulator`
    created with `layers=` drives it from then on.

    Raises:
        ValueError: on `renorm=True`, which cannot be honoured with per-window
            statistics.

    Example:

    >>> import keras, numpy as np, gradaccum
    >>> model = keras.Sequential([
    ...     keras.Input((3,)), keras.layers.Dense(4), gradaccum.BatchNormalization(),
    ...     keras.layers.Dense(1)])
    >>> trainer = gradaccum.wrap(model, steps=2)
    >>> trainer.compile(optimizer="sgd", loss="mse")
    >>> x = np.arange(24, dtype="float32").reshape(8, 3)
    >>> _ = trainer.fit(x, np.ones((8, 1)), batch_size=2, verbose=0)
    >>> bn = model.layers[1]
    >>> float(bn.window_count.numpy().max())  # every window applied: nothing pending
    0.0
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_options(
            {"renorm": self.renorm, "synchronized": self.synchronized}, self.name
        )
        # Whether an accumulator drives the layer: read when a step is traced.
        self._accumulated = False

    def build(self, input_shape):
        super().build(input_shape)
        channels = (input_shape[self.axis],)

        def state(name, shape):
            # Replica-local under a strategy: each replica pools its own shares.
            return kc.add_replica_local_weight(self, name, shape)

        # The micro-batch being computed (one or more forward passes), and the
        # accepted micro-batches of the open window. Counts are per channel: a mask
        # broadcast along another axis than the channels' weighs channels apart.
        self.micro_count = state("micro_count", channels)
        self.micro_mean = state("micro_mean", channels)
        self.micro_m2 = state("micro_m2", channels)
        self.window_count = state("window_count", channels)
        self.window_mean = state("window_mean", channels)
        self.window_m2 = state("window_m2", channels)

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable and self._accumulated):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            # Keras's own message for the same mistake.
            return super().call(inputs, training=training, mask=mask)
        # Statistics in float32 (float64 for float64 inputs), as Keras's layer.
        inputs = tf.cast(inputs, tf.float64 if inputs.dtype == tf.float64 else tf.float32)
        mean, variance = kc.batch_norm_moments(self, inputs, mask)
        count = self._count(inputs, mask)
        if self.synchronized:
            count, mean, variance = self._across_replicas(count, mean, variance)
            mean, variance = tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
        self._record(count, mean, variance)
        gamma = tf.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = tf.cast(self.beta, inputs.dtype) if self.center else None
        outputs = keras.ops.batch_normalization(
            inputs, mean, variance, axis=self.axis, offset=beta, scale=gamma,
            epsilon=self.epsilon,
        )
        return tf.cast(outputs, self.compute_dtype)

    # Window statistics ----------------------------------------------------------

    def _count(self, inputs, mask):
        """Elements per channel that the micro-batch's moments average over."""
        if mask is None:
            channels = tf.shape(inputs)[self.axis]
            per_channel = tf.cast(tf.size(inputs), tf.float32) / tf.cast(channels, tf.float32)
            return tf.fill([channels], per_channel)
        # Keras's layer broadcasts the mask along the last axis.
        weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.float32), -1),
                                  tf.shape(inputs))
        return tf.reduce_sum(weights, axis=kc.batch_norm_reduction_axes(self))

    def _across_replicas(self, count, mean, variance):
        """synchronized=True: the micro-batch's statistics over every replica's
        share, in one all-reduce of shifted sums (the replica's own on one)."""
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return count, mean, variance
        shift = tf.cast(self.moving_mean, tf.float32)
        mean = tf.cast(tf.reshape(mean, [-1]), tf.float32)
        m2 = tf.cast(tf.reshape(variance, [-1]), tf.float32) * count
        summed = context.all_reduce(
            tf.distribute.ReduceOp.SUM, shifted_sums(count, mean, m2, shift)
        )
        return from_shifted_sums(summed, shift)

    def _record(self, count, mean, variance):
        mean = tf.cast(tf.reshape(mean, [-1]), tf.float32)
        m2 = tf.cast(tf.reshape(variance, [-1]), tf.float32) * count
        self._assign_micro(merge_moments(self._micro(), (count, mean, m2)))

    def _micro(self):
        return self.micro_count, self.micro_mean, self.micro_m2

    def _window(self):
        return self.window_count, self.window_mean, self.window_m2

    def _assign_micro(self, moments):
        for variable, value in zip(self._micro(), moments):
            variable.assign(value)

    def _assign_window(self, moments):
        for variable, value in zip(self._window(), moments):
            variable.assign(value)

    def _accept_micro_batch(self):
        """The micro-batch's gradient was accumulated: pool its statistics."""
        self._assign_window(
            merge_moments(
                [v.value for v in self._window()], [v.value for v in self._micro()]
            )
        )
        self._discard_micro_batch()

    def _discard_micro_batch(self):
        for variable in self._micro():
            variable.assign(tf.zeros_like(variable))

    # Saving: the layer's own file entries are Keras's ------------------------------

    def _state_variables(self):
        return (*self._micro(), *self._window())

    def _keras_variables(self):
        state = {id(v) for v in self._state_variables()}
        every = kc.own_variables(self)
        return [v for v in every if id(v) not in state]

    def save_own_variables(self, store):
        # Gamma, beta and the moving statistics, in Keras's order, so that weight
        # files move between this layer and Keras's. The pending window is saved
        # by `wrap`'s model (and by `tf.train.Checkpoint` in custom loops).
        for i, variable in enumerate(self._keras_variables()):
            store[f"{i}"] = variable

    def load_own_variables(self, store):
        variables = self._keras_variables()
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Layer {self.name!r} expects {len(variables)} variables (those of "
                "keras.layers.BatchNormalization with the same options). Received: "
                f"{len(store.keys())} variables."
            )
        for i, variable in enumerate(variables):
            variable.assign(store[f"{i}"])
        self._reset_window()

    def _window_sums(self):
        """This replica's window as `shifted_sums` around the moving mean (the same
        on every replica): what the update's reduction sums."""
        count, mean, m2 = (v.value for v in self._window())
        return shifted_sums(count, mean, m2, tf.cast(self.moving_mean, tf.float32))

    def _window_sums_size(self) -> int:
        return 3 * int(self.moving_mean.shape[0])

    def _commit_pooled(self, sums):
        """The update under a strategy: the replicas' `_window_sums`, summed, move
        the moving statistics once; then reset."""
        count, mean, variance = from_shifted_sums(sums, tf.cast(self.moving_mean, tf.float32))
        self._move(count > 0, mean, variance)

    def _commit_window(self):
        """The optimizer updated: move the moving statistics once, then reset."""
        count, mean, m2 = (v.value for v in self._window())
        self._move(count > 0, mean, tf.math.divide_no_nan(m2, count))

    def _move(self, recorded, mean, variance):
        momentum = tf.constant(self.momentum, tf.float32)
        for moving, window in ((self.moving_mean, mean), (self.moving_variance, variance)):
            current = tf.cast(moving.value, tf.float32)
            updated = current * momentum + window * (1.0 - momentum)
            moving.assign(tf.cast(tf.where(recorded, updated, current), moving.dtype))
        self._reset_window()

    def _reset_window(self):
        for variable in (*self._window(), *self._micro()):
            variable.assign(tf.zeros_like(variable))


@contextlib.contextmanager
def driving(layers):
    """Within the block (a training step being traced), `layers` record window
    statistics."""
    previous = [layer._accumulated for layer in layers]
    for layer in layers:
        layer._accumulated = True
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer._accumulated = value


def batch_normalization_layers(layers) -> list[BatchNormalization]:
    """The `gradaccum.BatchNormalization` layers in `layers` (models or layers)."""
    if layers is None:
        return []
    if isinstance(layers, keras.layers.Layer):
        layers = [layers]
    found = []
    for item in layers:
        if not isinstance(item, keras.layers.Layer):
            raise ValueError(
                "`layers` must be a Keras layer or model, or a list of them. "
                f"Received: an element of type {type(item).__name__}: {item!r}"
            )
        for layer in flatten_layers(item):
            if isinstance(layer, BatchNormalization) and layer not in found:
                found.append(layer)
    return found


def _plain_batch_normalization(layer) -> bool:
    return isinstance(layer, keras.layers.BatchNormalization) and not isinstance(
        layer, BatchNormalization
    )


def convert_batch_normalization(model):
    """A copy of `model` whose Keras BatchNormalization layers are gradaccum's.

    Every layer is cloned (nested Sequential and functional models too) and its
    weights copied: gamma, beta and the moving statistics carry over, the copy shares
    no variable with `model`, and its predictions in inference mode are those of
    `model`. `model` itself is left as it was.

    Args:
        model: a Sequential or functional `keras.Model` (a subclassed model cannot be
            cloned: build it with `gradaccum.BatchNormalization` instead).

    Returns:
        The converted `keras.Model`.

    Raises:
        ValueError: for a subclassed model, a BatchNormalization layer with an
            option gradaccum cannot honour (`renorm`), or one inside
            a wrapper or custom layer, which cloning cannot reach.

    Example:

    >>> import keras, numpy as np, gradaccum
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
    ...                           keras.layers.BatchNormalization()])
    >>> converted = gradaccum.convert_batch_normalization(model)
    >>> type(converted.layers[1]).__module__
    'gradaccum.batch_norm'
    >>> x = np.ones((2, 3), "float32")
    >>> bool(np.array_equal(model.predict(x, verbose=0), converted.predict(x, verbose=0)))
    True
    """
    if not isinstance(model, (keras.Sequential, Functional)):
        raise ValueError(
            "`model` must be a Sequential or functional keras.Model to convert its "
            "BatchNormalization layers. Received: model of type "
            f"{type(model).__name__}. Build a subclassed model with "
            "`gradaccum.BatchNormalization` instead."
        )
    for layer in flatten_layers(model):
        if _plain_batch_normalization(layer):
            _check_options(layer.get_config(), layer.name)
    pairs = []

    def clone(layer):
        if _plain_batch_normalization(layer):
            new = BatchNormalization.from_config(layer.get_config())
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    converted = keras.models.clone_model(model, clone_function=clone, recursive=True)
    left = [
        layer.name for layer in flatten_layers(converted) if _plain_batch_normalization(layer)
    ]
    if left:
        raise ValueError(
            "Every BatchNormalization layer must be reachable to convert it: layers "
            "inside a wrapper or a custom layer (e.g. TimeDistributed) cannot be "
            f"replaced. Received: {', '.join(repr(n) for n in left)} inside such "
            "layers. Build those with `gradaccum.BatchNormalization` instead."
        )
    for old, new in pairs:
        if isinstance(new, BatchNormalization) and _plain_batch_normalization(old):
            # Gamma, beta (when present) and the moving statistics; the window
            # state, which Keras's layer does not have, starts empty.
            targets = {w.name: w for w in new.weights}
            for source in old.weights:
                targets[source.name].assign(source.value)
        elif old.weights:
            new.set_weights(old.get_weights())
    return converted
