"""Keras's own BatchNormalization layers followed through the window, for every
backend, without replacing a layer.

In training, Keras's `BatchNormalization` normalizes each forward pass with that
batch's mean and variance and moves its moving statistics at once:

    moving = moving * momentum + statistic * (1 - momentum)

Under accumulation that is one move per micro-batch, k per update, each from a
small batch. Following a layer keeps the forward pass as it is (each micro-batch
normalized with its own statistics, as in ghost batch normalization) and moves the
moving statistics once per update, from the window's pooled statistics, as the
same model trained on the window as one batch would:

1. **recover**: the move is known, so a micro-batch's own mean and variance are
   read back from it: `statistic = (moved - start * m) / (1 - m)`, `start` the
   moving statistic before the micro-batch (a forward pass that ran the layer `n`
   times moved it by `m = momentum ** n`: the passes' statistics averaged with
   Keras's weights are what is recovered). Rounding: the recovered statistic is off
   by about `eps * |moving| / (1 - m)`, which the update multiplies by `1 - m`
   again: the moving mean ends within float32's resolution of Keras's, the moving
   variance within 1e-6 relative where |mean| / std is small, more where it is
   large (measured against plain Keras after 2 epochs: 6e-6 relative at |mean| /
   std = 100 and m = 0.99, 3.5e-5 at 1000 and m = 0.999, 7e-4 at 10^4).
2. **pool**: an accepted micro-batch joins the window's statistics per channel as a
   (count, mean, m2) triple, merged exactly with the spread between the
   micro-batches' means (Chan's pairwise update, stable in float32); the count is
   the elements per channel the layer's moments averaged over (its mask's where it
   has one, on TensorFlow). The moving statistics go back to `start`.
3. **move once**: when the window's update is applied, `moving = start * m + pooled
   * (1 - m)`; a window that closes without an update (dropped) is forgotten.

The window's statistics are accumulation state (saved with the rest, restored in
the middle of a window); the layer, its variables and its saved file are Keras's.

What a backend writes: where the moving variables and the window's statistics live
(TensorFlow variables; arrays in JAX's trainer state), reading `start` before the
forward pass and the moved values after it, and telling `step` whether the
micro-batch was accepted and whether its window was applied or closed.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import NamedTuple

import keras

ops = keras.ops

#: The values of the `moving_statistics` option.
MODES = ("window", "micro_batch")


def statistics_names(index: int) -> tuple:
    """The state's names of followed layer `index`'s window statistics (count, mean
    and the sum of squared deviations, per channel)."""
    return (f"moving_{index}_count", f"moving_{index}_mean", f"moving_{index}_m2")


class Followed(NamedTuple):
    """A followed layer and its number of channels."""

    layer: object
    channels: int


def _overrides(layer, name: str) -> bool:
    base = getattr(keras.layers.BatchNormalization, name)
    return getattr(type(layer), name) is not base


def unfollowable_reason(layer) -> str | None:
    """Why `layer` (a layer with moving statistics) cannot be followed, or None."""
    if isinstance(layer, keras.layers.BatchNormalization):
        if getattr(layer, "renorm", False):
            return ("`renorm=True` moves its renorm statistics too and corrects every "
                    "micro-batch with them")
        if _overrides(layer, "call") or _overrides(layer, "_moments"):
            return (f"its class {type(layer).__name__} computes or moves its statistics "
                    "in a `call` of its own")
        return None
    return (f"{type(layer).__name__} moves statistics of its own (non-trainable "
            "variables named moving_*), in a way gradaccum does not know")


def _has_moving_statistics(layer) -> bool:
    """Whether a layer's own non-trainable variables include moving statistics."""
    own = getattr(layer, "_non_trainable_variables", [])
    return any(v.name.startswith("moving_") for v in own)


def window_aware(layer) -> bool:
    """Whether `layer` is gradaccum's own window-aware layer (TensorFlow's
    `gradaccum.BatchNormalization`, driven by its accumulator): not followed."""
    return getattr(type(layer), "_gradaccum_window_aware", False)


def find(model, layers) -> tuple[list, list]:
    """The batch normalization layers of `model` that can be followed, and
    `(layer, why)` for those with moving statistics that cannot. `layers`: the
    model's, nested ones included."""
    followed, refused = [], []
    seen = set()
    for layer in layers:
        if layer is model or id(layer) in seen or window_aware(layer):
            continue
        seen.add(id(layer))
        if not (isinstance(layer, keras.layers.BatchNormalization)
                or _has_moving_statistics(layer)):
            continue
        if not layer.built:
            continue
        why = unfollowable_reason(layer)
        if why is None and float(layer.momentum) >= 1.0:
            continue  # its statistics never move: nothing to follow
        if why is None:
            followed.append(Followed(layer, int(layer.moving_mean.shape[0])))
        else:
            refused.append((layer, why))
    return followed, refused


def warn_unfollowed(refused) -> None:
    """A warning naming each layer whose moving statistics keep moving per
    micro-batch."""
    for layer, why in refused:
        warnings.warn(
            f"Layer {layer.name!r} moves its moving statistics at every micro-batch "
            f"under gradaccum: it cannot be followed through the window ({why}). Its "
            "statistics are those of the micro-batches, not of the window; use "
            "keras.layers.BatchNormalization (without renorm) to have them follow the "
            "window, or pass moving_statistics=\"micro_batch\" to silence this.",
            stacklevel=4,
        )


def warn_unbuilt(model, layers) -> None:
    """A model not built when its state is made (a subclassed model with its own
    `train_step`, built by its first step): a warning names its batch normalization
    layers (of `layers`, the model's), which move per micro-batch in this fit."""
    names = [layer.name for layer in layers
             if isinstance(layer, keras.layers.BatchNormalization)
             and not window_aware(layer)]
    if not names:
        return
    warnings.warn(
        f"BatchNormalization layers {', '.join(repr(n) for n in names)} of model "
        f"{model.name!r} move their moving statistics at every micro-batch in this fit: "
        "the model was not built when gradaccum's state was made (a subclassed model "
        "with its own train_step is built by its first step), so they cannot follow "
        "the window. Build the model before fit (call it on a batch, or give it an "
        "Input) to have them follow it.",
        stacklevel=4,
    )


def warn_replicas(followed, replicas: int) -> None:
    """Under a tf.distribute strategy of several replicas Keras's layers are not
    followed: a warning names them and what pools the global window."""
    names = ", ".join(repr(f.layer.name) for f in followed)
    warnings.warn(
        f"Keras's BatchNormalization layers {names} move their moving statistics at "
        f"every micro-batch under a tf.distribute strategy of {replicas} replicas: "
        "gradaccum follows Keras's layers through the window on one device and under "
        "keras.distribution, not across tf.distribute replicas. For the global "
        "window's statistics, moved once per update, use gradaccum.BatchNormalization "
        "(wrap(..., convert_batch_norm=True) converts a model's layers), or pass "
        "moving_statistics=\"micro_batch\" to silence this.",
        stacklevel=4,
    )


class Follower:
    """The followed layers of a model, and the window statistics' arithmetic
    (`keras.ops`, every backend).

    Args:
        layers: the `Followed` layers.
    """

    def __init__(self, layers):
        self.layers = list(layers)
        # While a micro-batch's forward pass is traced: how many times each layer
        # computed training moments, and the element counts it averaged over.
        self.passes = [0] * len(self.layers)
        self.counts = [[] for _ in self.layers]
        # The passes of the last traced micro-batch that ran the layer (a window
        # closed outside a step moves by the momentum they make).
        self.last_passes = [1] * len(self.layers)
        self._recording = False
        self._installed = []
        self._masked_warned = set()
        self._repeated_warned = set()

    def __bool__(self) -> bool:
        return bool(self.layers)

    def fields(self) -> list:
        """`(name, channels)` of every field of the window statistics."""
        return [(name, f.channels) for i, f in enumerate(self.layers)
                for name in statistics_names(i)]

    def names(self) -> list:
        """The names of the window statistics' fields, in order."""
        return [name for name, _ in self.fields()]

    def moving(self) -> list:
        """Each followed layer's moving (mean, variance) variables, in order."""
        return [(f.layer.moving_mean, f.layer.moving_variance) for f in self.layers]

    # Observing the forward pass -----------------------------------------------------

    def install(self) -> None:
        """Observes each followed layer's training moments (an instance attribute
        over Keras's `_moments`; the layer's class and variables unchanged). A layer
        several accumulated models share is observed once, for each of them."""
        for index, followed in enumerate(self.layers):
            layer = followed.layer
            watchers = _watchers(layer)
            if any(f is self for f, _ in watchers):
                continue
            watchers.append((self, index))
            self._installed.append(layer)

    def uninstall(self) -> None:
        for layer in self._installed:
            watchers = _watchers(layer)
            watchers[:] = [(f, i) for f, i in watchers if f is not self]
            if not watchers:
                layer.__dict__.pop("_moments", None)
                layer.__dict__.pop(_WATCHERS, None)
        self._installed = []

    @contextlib.contextmanager
    def observing(self):
        """While a micro-batch's forward pass is traced (or run eagerly): counts
        each layer's passes and elements."""
        self.passes = [0] * len(self.layers)
        self.counts = [[] for _ in self.layers]
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            for i, passes in enumerate(self.passes):
                if passes:
                    self.last_passes[i] = passes

    def _observe(self, index, layer, inputs, mask) -> None:
        self.passes[index] += 1
        if self.passes[index] == 2 and index not in self._repeated_warned:
            self._repeated_warned.add(index)
            warnings.warn(
                f"Layer {layer.name!r} normalizes several batches in one micro-batch "
                "(a layer shared between branches, inside TimeDistributed, or a step "
                "that calls the model twice): gradaccum follows it through the "
                "window from its statistics averaged over those passes, so its moving "
                "mean moves as on the large batch but its moving variance leaves out "
                "the spread between the micro-batches within each pass (measured: 8% "
                "low for TimeDistributed over 7 steps, 1% for a layer shared by two "
                "branches).",
                stacklevel=2,
            )
        shape = tuple(inputs.shape)
        channels = shape[layer.axis]
        if mask is not None and keras.backend.backend() == "tensorflow":
            mask = ops.broadcast_to(ops.expand_dims(ops.cast(mask, "float32"), -1),
                                    ops.shape(inputs))
            axes = [a for a in range(len(shape)) if a != layer.axis % len(shape)]
            count = ops.sum(mask, axis=axes)
        else:
            if mask is not None and index not in self._masked_warned:
                self._masked_warned.add(index)
                warnings.warn(
                    f"Layer {layer.name!r} weighs its statistics by a mask: on "
                    f"Keras's {keras.backend.backend()!r} backend gradaccum pools its "
                    "micro-batches' statistics by their element counts, not their "
                    "masks' (exact when the micro-batches' masked fractions are equal).",
                    stacklevel=2,
                )
            if all(isinstance(d, int) for d in shape):
                count = float(math.prod(shape) // channels)
            else:
                count = ops.cast(ops.size(inputs), "float32") / float(channels)
        self.counts[index].append(count)

    # The arithmetic ----------------------------------------------------------------

    def step(self, statistics: dict, start: list, moved: list | None, accepted, applied,
             closed) -> tuple[dict, list]:
        """One micro-batch's end for every followed layer: its statistics recovered
        from the move and pooled into the window where `accepted`; then, where
        `applied`, the moving statistics moved once from the window's; where
        `closed`, the window's statistics emptied.

        Args:
            statistics: the window statistics by name (`fields`).
            start: per layer, the (mean, variance) before the micro-batch.
            moved: per layer, the (mean, variance) after its forward pass (None: no
                micro-batch, a window closed outside a step).

        Returns:
            The new window statistics, and per layer the (mean, variance) the
            moving variables take.
        """
        statistics = dict(statistics)
        values = []
        for i, followed in enumerate(self.layers):
            names = statistics_names(i)
            window = tuple(statistics[n] for n in names)
            passes = self.passes[i] if moved is not None else 0
            if passes and moved is not None:
                micro = self._recovered(followed.layer, start[i], moved[i], passes,
                                        self.counts[i], followed.channels)
                window = _where(accepted, _merged(window, micro), window)
            momentum = followed.layer.momentum ** max(self.last_passes[i], 1)
            mean, variance = start[i]
            count, pooled_mean, m2 = window
            has = count > 0
            pooled_variance = ops.divide_no_nan(m2, count)
            moves = _both(has, applied)
            mean = _where(moves, _moved(mean, pooled_mean, momentum), mean)
            variance = _where(moves, _moved(variance, pooled_variance, momentum), variance)
            window = _where(closed, tuple(ops.zeros_like(t) for t in window), window)
            statistics.update(zip(names, window))
            values.append((mean, variance))
        return statistics, values

    @staticmethod
    def _recovered(layer, start, moved, passes, counts, channels):
        """(count, mean, variance) of a micro-batch, from its move."""
        momentum = layer.momentum ** passes
        rest = 1.0 - momentum
        mean = (ops.cast(moved[0], "float32") - ops.cast(start[0], "float32") * momentum) / rest
        variance = ops.maximum(
            (ops.cast(moved[1], "float32") - ops.cast(start[1], "float32") * momentum) / rest,
            0.0,
        )
        count = counts[0]
        for more in counts[1:]:
            count = count + more
        count = ops.cast(count, "float32") / float(len(counts))
        count = ops.broadcast_to(ops.reshape(count, (-1,)), (channels,))
        return count, mean, variance


_WATCHERS = "_gradaccum_moving_statistics_watchers"


def _watchers(layer) -> list:
    """The `(follower, index)` pairs observing `layer`, its observer installed with
    the first."""
    watchers = layer.__dict__.get(_WATCHERS)
    if watchers is None:
        watchers = []
        original = layer._moments

        def observed(inputs, mask):
            for follower, index in list(watchers):
                if follower._recording:
                    follower._observe(index, layer, inputs, mask)
            return original(inputs, mask)

        object.__setattr__(layer, _WATCHERS, watchers)
        object.__setattr__(layer, "_moments", observed)
    return watchers


def _moved(moving, statistic, momentum):
    """Keras's move, in float32."""
    moving32 = ops.cast(moving, "float32")
    return ops.cast(moving32 * momentum + ops.cast(statistic, "float32") * (1.0 - momentum),
                    moving.dtype)


def _merged(window, micro):
    """A window's (count, mean, m2) with a micro-batch's (count, mean, variance):
    the exact pooled mean and sum of squared deviations."""
    count_a, mean_a, m2_a = window
    count_b, mean_b, variance_b = micro
    count = count_a + count_b
    share = ops.divide_no_nan(count_b, count)
    delta = mean_b - mean_a
    mean = mean_a + delta * share
    m2 = m2_a + variance_b * count_b + ops.square(delta) * count_a * share
    return count, mean, m2


def _both(a, b):
    if isinstance(b, bool):
        return a if b else False
    return ops.logical_and(a, b)


def _where(condition, new, old):
    if isinstance(condition, bool):
        return new if condition else old
    if isinstance(old, tuple):
        return tuple(_where(condition, n, o) for n, o in zip(new, old))
    return ops.where(condition, ops.cast(new, old.dtype), old)
