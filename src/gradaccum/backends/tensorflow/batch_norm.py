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
from collections.abc import Iterable, Iterator
from typing import Any

import keras
import tensorflow as tf

from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow.keras_compat import Functional, flatten_layers

_REFUSED = {
    "renorm": "batch renormalization corrects every micro-batch with moving statistics "
    "that would change once per window",
}


def power_sums(count: Any, mean: Any, variance: Any) -> Any:
    """A group's statistics per channel (its count, mean and biased variance) as
    float64 power sums stacked flat: the count, the sum and the sum of squares.

    Power sums add: micro-batches pool into a window, and the replicas' windows into
    the global window, by summing (one all-reduce). In float64 the subtraction that
    recovers the variance (`moments_of`) loses about 1e-16 (1 + (mean / std)^2)
    relative, below float32's resolution while |mean| / std < 10^4.
    """
    count, mean, variance = (
        tf.cast(tf.reshape(t, [-1]), tf.float64) for t in (count, mean, variance)
    )
    return tf.concat([count, count * mean, count * (variance + tf.square(mean))], axis=0)


def moments_of(sums: Any) -> tuple[Any, Any, Any]:
    """The (count, mean, biased variance) of summed `power_sums`, in float64 (the
    caller casts where it uses them); an empty group has mean and variance 0."""
    count, total, squares = tf.split(sums, 3)
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
    return count, mean, variance


# A replica's row per channel: count, mean (as a float32 pair, high and low parts),
# spread (m2).
SLOT_FIELDS = 4


def pool_replicas(gathered: Any, replicas: int) -> tuple[Any, Any, Any]:
    """The global window's (count, mean, biased variance), float64, from the
    replicas' `_replica_slots` summed across replicas (each replica wrote its row:
    the sum gathers them). Pooled exactly, with the spread between the replicas'
    means; each mean crossed as a float32 pair (high + low), so float32 transport
    costs it nothing."""
    rows = tf.reshape(tf.cast(gathered, tf.float64), [replicas, SLOT_FIELDS, -1])
    count, mean, m2 = rows[:, 0], rows[:, 1] + rows[:, 2], rows[:, 3]
    total = tf.reduce_sum(count, axis=0)
    pooled = tf.math.divide_no_nan(tf.reduce_sum(count * mean, axis=0), total)
    spread = tf.reduce_sum(m2 + count * tf.square(mean - pooled), axis=0)
    return total, pooled, tf.math.divide_no_nan(spread, total)


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
    left out; a dropped partial window is forgotten. The window is kept as float64
    power sums per channel (count, sum, sum of squares: `power_sums`), exact for any
    split of the window up to |mean| / std of about 10^4.

    Under a strategy with several replicas each replica pools its own shares; at the
    update the replicas' windows are gathered in the accumulator's one reduction and
    pooled exactly, so the moving statistics move once, from the global window's
    statistics. With `synchronized=True` each micro-batch is normalized with the
    statistics of all replicas' shares (one all-reduce per micro-batch and layer, as
    Keras's synchronized layer needs too).

    The pending window is layer state (`window_count`, `window_sum`, `window_square`,
    per channel), saved by `wrap`'s and `accumulate`'s models with their
    accumulation state and by `tf.train.Checkpoint`. The layer's own weight entries
    are Keras's (gamma, beta, moving statistics), so weight files move between this
    layer and Keras's.

    Not driven by an accumulator (plain `fit`, inference), it is Keras's layer.
    `wrap` drives it only inside its own training step; a `GradientAccumulator`
    created with `layers=` drives it from then on.

    Raises:
        ValueError: on `renorm=True`, which cannot be honoured with per-window
            statistics.

    Examples:

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

    # Window-aware itself: not followed by `core.moving_statistics`.
    _gradaccum_window_aware = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _check_options(
            {"renorm": self.renorm, "synchronized": self.synchronized}, self.name
        )
        # Whether an accumulator drives the layer: read when a step is traced.
        self._accumulated = False

    def build(self, input_shape: Any) -> None:
        super().build(input_shape)
        channels = (input_shape[self.axis],)

        def state(name: str, shape: tuple[int, ...]) -> Any:
            # Replica-local under a strategy: each replica pools its own shares.
            return kc.add_replica_local_weight(self, name, shape, "float64")

        # The micro-batch being computed (one or more forward passes), and the
        # accepted micro-batches of the open window. Counts are per channel: a mask
        # broadcast along another axis than the channels' weighs channels apart.
        self.micro_count = state("micro_count", channels)
        self.micro_sum = state("micro_sum", channels)
        self.micro_square = state("micro_square", channels)
        self.window_count = state("window_count", channels)
        self.window_sum = state("window_sum", channels)
        self.window_square = state("window_square", channels)

    def call(self, inputs: Any, training: bool | None = None, mask: Any = None) -> Any:
        if not (training and self.trainable and self._accumulated):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            # Keras's own message for the same mistake.
            return super().call(inputs, training=training, mask=mask)
        # Statistics in float32 (float64 for float64 inputs), as Keras's layer.
        inputs = tf.cast(inputs, tf.float64 if inputs.dtype == tf.float64 else tf.float32)
        mean, variance = kc.batch_norm_moments(self, inputs, mask)
        count = self._count(inputs, mask)
        # An empty share (a last batch smaller than the replica count) has no
        # moments: Keras's are nan, which would poison its gradient.
        present = tf.reshape(count, tf.shape(mean)) > 0
        mean = tf.where(present, mean, tf.zeros_like(mean))
        variance = tf.where(present, variance, tf.zeros_like(variance))
        if self.synchronized:
            count, mean, variance = self._across_replicas(count, mean, variance)
        self._record(count, mean, variance)
        mean, variance = tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
        gamma = tf.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = tf.cast(self.beta, inputs.dtype) if self.center else None
        outputs = keras.ops.batch_normalization(
            inputs, mean, variance, axis=self.axis, offset=beta, scale=gamma,
            epsilon=self.epsilon,
        )
        return tf.cast(outputs, self.compute_dtype)

    # Window statistics ----------------------------------------------------------

    def _count(self, inputs: Any, mask: Any) -> Any:
        """Elements per channel that the micro-batch's moments average over."""
        if mask is None:
            channels = tf.shape(inputs)[self.axis]
            per_channel = tf.cast(tf.size(inputs), tf.float32) / tf.cast(channels, tf.float32)
            return tf.fill([channels], per_channel)
        # Keras's layer broadcasts the mask along the last axis.
        weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.float32), -1),
                                  tf.shape(inputs))
        return tf.reduce_sum(weights, axis=kc.batch_norm_reduction_axes(self))

    def _across_replicas(self, count: Any, mean: Any, variance: Any) -> tuple[Any, Any, Any]:
        """synchronized=True: the micro-batch's statistics over every replica's
        share, in one all-reduce of its power sums (the replica's own on one)."""
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return count, mean, variance
        summed = context.all_reduce(
            tf.distribute.ReduceOp.SUM, power_sums(count, mean, variance)
        )
        return moments_of(summed)

    def _record(self, count: Any, mean: Any, variance: Any) -> None:
        """Adds a forward pass's statistics to the micro-batch's (a micro-batch may
        take several forward passes)."""
        sums = tf.split(power_sums(count, mean, variance), 3)
        for variable, value in zip(self._micro(), sums):
            variable.assign_add(value)

    def _micro(self) -> tuple[Any, Any, Any]:
        return self.micro_count, self.micro_sum, self.micro_square

    def _window(self) -> tuple[Any, Any, Any]:
        return self.window_count, self.window_sum, self.window_square

    def _accept_micro_batch(self) -> None:
        """The micro-batch's gradient was accumulated: pool its statistics."""
        for window, micro in zip(self._window(), self._micro()):
            window.assign_add(micro.value)
        self._discard_micro_batch()

    def _discard_micro_batch(self) -> None:
        for variable in self._micro():
            variable.assign(tf.zeros_like(variable))

    # Saving: the layer's own file entries are Keras's ------------------------------

    def _state_variables(self) -> tuple[Any, ...]:
        return (*self._micro(), *self._window())

    def _keras_variables(self) -> list:
        state = {id(v) for v in self._state_variables()}
        every = kc.own_variables(self)
        return [v for v in every if id(v) not in state]

    def save_own_variables(self, store: Any) -> None:
        # Gamma, beta and the moving statistics, in Keras's order, so that weight
        # files move between this layer and Keras's. The pending window is saved
        # by `wrap`'s model (and by `tf.train.Checkpoint` in custom loops).
        for i, variable in enumerate(self._keras_variables()):
            store[f"{i}"] = variable

    def load_own_variables(self, store: Any) -> None:
        variables = self._keras_variables()
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Layer {self.name!r} expects {len(variables)} variables (those of "
                "keras.layers.BatchNormalization with the same options). Received: "
                f"{len(store.keys())} variables."
            )
        for i, variable in enumerate(variables):
            variable.assign(store[f"{i}"])
        # The pending window is accumulation state: it is restored (or kept) with
        # the accumulators, by whoever restores those.

    def _replica_slots(self, replica: Any, replicas: int, dtype: Any) -> Any:
        """This replica's window as (count, mean, m2) per channel in its own row of
        a zero [replicas, SLOT_FIELDS, channels] block, flat: summed across replicas
        (the update's one reduction, whose tensors share one dtype) it gathers every
        replica's window for `pool_replicas`. The mean goes as a high and a low
        part, so that a float32 reduction carries it to float64 precision."""
        count, total, squares = (v.value for v in self._window())
        mean = tf.math.divide_no_nan(total, count)
        m2 = tf.maximum(squares - count * tf.square(mean), 0.0)
        high = tf.cast(mean, dtype)
        low = tf.cast(mean - tf.cast(high, tf.float64), dtype)
        row = tf.concat([tf.cast(count, dtype), high, low, tf.cast(m2, dtype)], axis=0)
        slot = tf.one_hot(replica, replicas, dtype=dtype)
        return tf.reshape(slot[:, None] * row[None, :], [-1])

    def _replica_slots_size(self, replicas: int) -> int:
        return replicas * SLOT_FIELDS * int(self.moving_mean.shape[0])

    def _commit_window(self, moments: tuple[Any, Any, Any] | None = None) -> None:
        """The optimizer updated: the moving statistics move once, from the window's
        (count, mean, variance) (`moments`: the global window's under several
        replicas; None: this layer's own window), then the window resets."""
        if moments is None:
            moments = moments_of(tf.concat([v.value for v in self._window()], axis=0))
        count, mean, variance = moments
        recorded = count > 0
        for moving, window in ((self.moving_mean, mean), (self.moving_variance, variance)):
            # In float32 as Keras's layer (float64 for float64 statistics).
            dtype = tf.float64 if moving.dtype == tf.float64 else tf.float32
            current = tf.cast(moving.value, dtype)
            momentum = tf.constant(self.momentum, dtype)
            updated = current * momentum + tf.cast(window, dtype) * (1.0 - momentum)
            moving.assign(tf.cast(tf.where(recorded, updated, current), moving.dtype))
        self._reset_window()

    def _reset_window(self) -> None:
        for variable in (*self._window(), *self._micro()):
            variable.assign(tf.zeros_like(variable))


@contextlib.contextmanager
def driving(layers: Iterable[BatchNormalization]) -> Iterator[None]:
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


def batch_normalization_layers(layers: Any) -> list[BatchNormalization]:
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


def _plain_batch_normalization(layer: Any) -> bool:
    return isinstance(layer, keras.layers.BatchNormalization) and not isinstance(
        layer, BatchNormalization
    )


def convert_batch_normalization(model: keras.Model) -> keras.Model:
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

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
        ...                           keras.layers.BatchNormalization()])
        >>> converted = gradaccum.convert_batch_normalization(model)
        >>> type(converted.layers[1]) is gradaccum.BatchNormalization
        True
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

    def clone(layer: Any) -> Any:
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
