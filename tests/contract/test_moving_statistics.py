"""Keras's own BatchNormalization through `gradaccum.accumulate`, on every backend
(this module runs in the TensorFlow and in the JAX process): the moving mean and
variance move once per update, from the window's pooled statistics.

Two references. A layer whose input passes through no other batch normalization
sees the same inputs as the same model trained with plain Keras on the windows as
whole batches (the layer before it is frozen, or it reads the data): its moving
statistics must equal plain Keras's. A deeper layer sees inputs normalized per
micro-batch (the forward pass is per micro-batch): its moving statistics must equal
the pooled statistics of what it saw, computed here by hand from each micro-batch's
inputs to it at the window's weights.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from largebatch import reference_fit, windows_of

import gradaccum

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=60, features=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, features)) * 3.0 + 1.5).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


class TwoNorms(keras.Model):
    def __init__(self, momentum, **kwargs):
        super().__init__(**kwargs)
        self.frozen = keras.layers.Dense(6, name="frozen", trainable=False)
        self.bn = keras.layers.BatchNormalization(momentum=momentum, name="bn")
        self.hidden = keras.layers.Dense(4, activation="relu", name="hidden")
        self.bn2 = keras.layers.BatchNormalization(momentum=momentum, name="bn2")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x, training=False):
        h = self.bn(self.frozen(x), training=training)
        return self.out(self.bn2(self.hidden(h), training=training))

    def get_config(self):
        return dict(super().get_config(), momentum=self.bn.momentum)


def _model(kind="functional", momentum=0.9, seed=0):
    keras.utils.set_random_seed(seed)
    if kind == "subclassed":
        model = TwoNorms(momentum)
        model(np.zeros((1, 5), "float32"))
        return model
    layers = [
        keras.layers.Dense(6, name="frozen", trainable=False),
        keras.layers.BatchNormalization(momentum=momentum, name="bn"),
        keras.layers.Dense(4, activation="relu", name="hidden"),
        keras.layers.BatchNormalization(momentum=momentum, name="bn2"),
        keras.layers.Dense(3, name="out"),
    ]
    if kind == "sequential":
        return keras.Sequential([keras.Input((5,)), *layers])
    inputs = keras.Input((5,))
    h = inputs
    for layer in layers:
        h = layer(h)
    return keras.Model(inputs, h)


def _compiled(model, **options):
    steps = options.pop("steps", 3)
    gradaccum.accumulate(model, steps=steps, **options)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=SCE)
    return model


def _plain(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=SCE)
    return model


def _moving(model, name):
    layer = model.get_layer(name)
    return np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)


def _assert_moving_close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(a[0], b[0], rtol=rtol, atol=atol, err_msg="moving mean")
    np.testing.assert_allclose(a[1], b[1], rtol=rtol, atol=atol, err_msg="moving variance")


# 60 samples in micro-batches of 8: windows of 3 are (8, 8, 8), (8, 8, 8), (8, 8, 4).
WINDOWS = windows_of([8] * 7 + [4], [3, 3, 2])


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_a_first_layer_equals_plain_keras_on_the_windows_after_every_epoch(kind, momentum):
    x, y = _data()
    model = _compiled(_model(kind, momentum))
    reference = _plain(_model(kind, momentum))
    for _ in range(2):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        reference_fit(reference, WINDOWS, x, y)
        _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))
    # Per micro-batch (Keras's behaviour) the statistics are far from the windows'.
    keras_way = _compiled(_model(kind, momentum), moving_statistics="micro_batch")
    keras_way.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert np.max(np.abs(_moving(keras_way, "bn")[0] - _moving(model, "bn")[0])) > 1e-2


def test_the_moving_statistics_do_not_move_inside_a_window():
    # Two micro-batches of an open window (partial="carry" keeps it open): the
    # moving statistics are still the initial ones; the third moves them once.
    x, y = _data(24)
    model = _compiled(_model(), partial="carry")
    initial = _moving(model, "bn")
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_moving_close(_moving(model, "bn"), initial, rtol=0, atol=0)
    model.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference = _plain(_model())
    reference.train_on_batch(x, y)
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))


def _pooled_by_hand(model, names, micro_batches):
    """Each named layer's moving (mean, variance) after one update of the window
    `micro_batches`, from the statistics of its inputs in each micro-batch's
    forward pass at the current weights (upstream layers normalizing per
    micro-batch), pooled exactly."""
    layers = [model.get_layer(name) if isinstance(name, str) else name for name in names]
    extractor = keras.Model(model.inputs if not hasattr(model, "backbone")
                            else model.backbone.inputs, [layer.input for layer in layers])
    saved = [np.asarray(v) for v in model.weights]
    seen = [[] for _ in layers]
    for xb in micro_batches:
        outputs = extractor(xb, training=True)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        for i, out in enumerate(outputs):
            a = keras.ops.convert_to_numpy(out).astype("float64")
            axes = tuple(range(a.ndim - 1))
            seen[i].append((a.size / a.shape[-1], a.mean(axes), a.var(axes)))
    for variable, value in zip(model.weights, saved):
        variable.assign(value)
    expected = []
    for layer, parts in zip(layers, seen):
        counts = np.array([c for c, _, _ in parts])[:, None]
        means = np.stack([m for _, m, _ in parts])
        variances = np.stack([v for _, _, v in parts])
        mean = (counts * means).sum(0) / counts.sum()
        variance = (counts * (variances + (means - mean) ** 2)).sum(0) / counts.sum()
        m = layer.momentum
        start_mean, start_variance = (np.asarray(layer.moving_mean, "float64"),
                                      np.asarray(layer.moving_variance, "float64"))
        expected.append((start_mean * m + mean * (1 - m),
                         start_variance * m + variance * (1 - m)))
    return layers, expected


def _check_against_hand_pooling(model, x, y, sizes, names, steps=3, epochs=2, rtol=1e-5,
                                atol=1e-6):
    """Trains `model` one window per `fit` (each window `sizes` micro-batches) and
    checks every named layer after each window against `_pooled_by_hand`."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    micro = [x[a:b] for a, b in zip(starts[:-1], starts[1:])]
    for _ in range(epochs):
        for first in range(0, len(sizes), steps):
            batches = micro[first:first + steps]
            layers, expected = _pooled_by_hand(model, names, batches)
            a, b = starts[first], starts[first + len(batches)]
            model.fit(x[a:b], y[a:b], batch_size=int(sizes[first]), epochs=1,
                      shuffle=False, verbose=0)
            for layer, (mean, variance) in zip(layers, expected):
                np.testing.assert_allclose(np.asarray(layer.moving_mean), mean, rtol=rtol,
                                           atol=atol, err_msg=layer.name)
                np.testing.assert_allclose(np.asarray(layer.moving_variance), variance,
                                           rtol=rtol, atol=atol, err_msg=layer.name)


@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_every_layer_equals_its_inputs_statistics_pooled_by_hand(momentum):
    x, y = _data()
    model = _compiled(_model("functional", momentum))
    _check_against_hand_pooling(model, x, y, [8] * 7 + [4], ["bn", "bn2"])


@pytest.mark.skipif(keras.backend.backend() != "torch", reason=(
    "the suite's time budget: measured on PyTorch (13 s) where JAX takes 105 s to "
    "compile ResNet50's micro-batches and their hand pooling and TensorFlow 40 s; a real "
    "ResNet follows the window on every backend in "
    "test_a_keras_hub_resnet_image_classifier_follows_the_window"))
def test_keras_applications_resnet50_follows_the_window():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 4, size=(24,)).astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=4)
    names = [layer.name for layer in model.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(names) == 53
    gradaccum.accumulate(model, steps=3)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    # Windows of micro-batches (4, 4, 4) and (4, 4, 4): two moves of all 53 layers,
    # the second from the first's (the other tests go on over epochs).
    _check_against_hand_pooling(model, x, y, [4] * 6, names, epochs=1, rtol=2e-4,
                                atol=1e-5)


def test_a_keras_hub_resnet_image_classifier_follows_the_window():
    import keras_hub  # the README's test install has it: missing, this fails
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 3, size=(20,)).astype("int32")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32], stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2], block_type="basic_block", image_shape=(16, 16, 3),
    )
    task = keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=3,
                                                  preprocessor=None)
    layers = [layer for layer in backbone._flatten_layers(include_self=False)
              if isinstance(layer, keras.layers.BatchNormalization)]
    assert layers and {layer.momentum for layer in layers} == {0.9}
    gradaccum.accumulate(task, steps=3)
    task.compile(optimizer=keras.optimizers.Adam(1e-3), loss=SCE)
    # Unequal micro-batches: windows (8, 8, 4) twice.
    _check_against_hand_pooling(task, x, y, [8, 8, 4], layers, epochs=2, rtol=2e-4,
                                atol=1e-5)


@pytest.mark.parametrize("partial", ["drop", "carry"])
def test_partial_windows_drop_and_carry(partial):
    x, y = _data()
    model = _compiled(_model(), partial=partial)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference = _plain(_model())
    if partial == "drop":
        # The last window (8, 8, 4) of each epoch is dropped with its statistics.
        reference_fit(reference, WINDOWS[:2], x, y, epochs=2)
    else:
        # Windows run on across the epochs: 16 micro-batches, 5 windows of 3 and one
        # left open (its statistics pending, the moving ones not moved by it).
        twice = np.concatenate([x, x]), np.concatenate([y, y])
        sizes = ([8] * 7 + [4]) * 2
        reference_fit(reference, windows_of(sizes, [3] * 5), *twice)
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))


@pytest.mark.parametrize("steps", [1, 3])
def test_a_skipped_micro_batch_leaves_the_statistics(steps):
    # The second micro-batch holds a nan: its gradient is not finite, it is skipped,
    # and its statistics (nan) join nothing (with windows of one micro-batch too,
    # where the others move them as Keras does).
    x, y = _data(24)
    x_bad = x.copy()
    x_bad[9, 0] = np.nan
    model = _compiled(_model(), steps=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x_bad, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference = _plain(_model())
    if steps == 1:
        reference_fit(reference, [np.r_[0:8], np.r_[16:24]], x, y)
    else:
        reference.train_on_batch(x[np.r_[0:8, 16:24]], y[np.r_[0:8, 16:24]])
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))
    assert np.all(np.isfinite(_moving(model, "bn2")[0]))


def test_split_mode_moves_once_per_batch():
    x, y = _data()
    model = _compiled(_model(), steps=None, micro_batch_size=8)
    model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    reference = _plain(_model())
    reference_fit(reference, WINDOWS, x, y, epochs=2)
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))


def test_a_weight_budget_moves_once_per_update():
    x, y = _data(48)
    model = _compiled(_model(), steps=None, weight_per_update=16)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference = _plain(_model())
    reference_fit(reference, windows_of([8] * 6, [2, 2, 2]), x, y)
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))


def test_mixed_precision_follows_the_window():
    x, y = _data()
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _compiled(_model())
        reference = _plain(_model())
    finally:
        keras.config.set_dtype_policy(previous)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference_fit(reference, WINDOWS, x, y, epochs=2)
    assert model.get_layer("bn").moving_mean.dtype == "float32"
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"), rtol=1e-5,
                         atol=1e-5)


def test_a_restore_in_the_middle_of_a_window_continues_it(tmp_path):
    x, y = _data(24)
    path = str(tmp_path / "mid.weights.h5")
    first = _compiled(_model(), partial="carry")
    first.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    first.save_weights(path)
    second = _compiled(_model(seed=5), partial="carry")
    second.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    second.load_weights(path)
    second.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference = _plain(_model())
    reference.train_on_batch(x, y)
    _assert_moving_close(_moving(second, "bn"), _moving(reference, "bn"))


def test_layers_that_cannot_be_followed_are_named_and_the_option_is_checked():
    inputs = keras.Input((5,))
    h = keras.layers.BatchNormalization(renorm=True, name="renormed")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x, y = _data(24)
    _compiled(model)
    with pytest.warns(UserWarning, match="Layer 'renormed' moves its moving statistics"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    with pytest.raises(ValueError, match="`moving_statistics` must be one of 'window', "
                       "'micro_batch'. Received: moving_statistics='pooled'"):
        gradaccum.accumulate(_model(), steps=2, moving_statistics="pooled")


def test_disable_leaves_keras_layers_as_they_were():
    x, y = _data(24)
    model = _compiled(_model())
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    layer = model.get_layer("bn")
    assert type(layer) is keras.layers.BatchNormalization
    assert "_moments" in layer.__dict__
    gradaccum.disable(model)
    assert "_moments" not in layer.__dict__


def test_a_window_flushed_after_data_of_unknown_length_moves_once():
    # A generator has no length: the partial window is flushed after the data ends,
    # outside the step, and moves the statistics from what it holds.
    x, y = _data()

    def batches():
        for start in range(0, 60, 8):
            yield x[start:start + 8], y[start:start + 8]

    model = _compiled(_model())
    model.fit(batches(), epochs=1, verbose=0)
    reference = _plain(_model())
    reference_fit(reference, WINDOWS, x, y)
    _assert_moving_close(_moving(model, "bn"), _moving(reference, "bn"))


def test_a_layer_two_accumulated_models_share_follows_each_of_them():
    # One encoder (a frozen Dense and a BatchNormalization) in two models, each
    # accumulated: fit one, then the other; each moves the shared statistics once
    # per window, as plain Keras on the windows does.
    x, y = _data()

    def pair():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        encoder = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, trainable=False),
                                    keras.layers.BatchNormalization(momentum=0.9)])
        first = keras.Model(inputs, keras.layers.Dense(3)(encoder(inputs)))
        second = keras.Model(inputs, keras.layers.Dense(3)(encoder(inputs)))
        return first, second, encoder.layers[-1]

    first, second, bn = pair()
    for model in (first, second):
        _compiled(model)
    first.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    second.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    ref_first, ref_second, ref_bn = pair()
    for model in (ref_first, ref_second):
        reference_fit(_plain(model), WINDOWS, x, y)
    _assert_moving_close((np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)),
                         (np.asarray(ref_bn.moving_mean), np.asarray(ref_bn.moving_variance)))


def test_a_momentum_of_one_keeps_the_statistics():
    x, y = _data(24)
    inputs = keras.Input((5,))
    h = keras.layers.BatchNormalization(momentum=1.0, name="bn")(inputs)
    model = _compiled(keras.Model(inputs, keras.layers.Dense(3)(h)))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_moving_close(_moving(model, "bn"), (np.zeros(5), np.ones(5)), rtol=0, atol=0)


def test_a_layer_run_several_times_a_micro_batch_is_named_and_its_mean_follows():
    # TimeDistributed runs the layer on each of 3 steps: the mean moves as on the
    # windows; the variance leaves out the spread within each pass (said).
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(48, 3, 4)) * 2 + 1).astype("float32")
    y = rng.integers(0, 3, size=(48,)).astype("int32")

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3, 4))
        h = keras.layers.TimeDistributed(keras.layers.BatchNormalization(momentum=0.9),
                                         name="td")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))

    model = _compiled(make())
    with pytest.warns(UserWarning, match="normalizes several batches in one micro-batch"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference = _plain(make())
    reference_fit(reference, windows_of([8] * 6, [3, 3]), x, y)
    ours, theirs = model.get_layer("td").layer, reference.get_layer("td").layer
    np.testing.assert_allclose(np.asarray(ours.moving_mean), np.asarray(theirs.moving_mean),
                               rtol=1e-5, atol=1e-6)
