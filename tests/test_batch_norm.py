"""gradaccum.BatchNormalization: moving statistics from the pooled window."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum


def window_data(shape, sizes, seed=0):
    """Micro-batches of `shape` whose means differ: the spread between them counts."""
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(n, *shape)) * (1 + i) + 3.0 * i).astype("float32")
        for i, n in enumerate(sizes)
    ]


def twin_layers(config, input_shape, seed=1):
    """A Keras BatchNormalization and gradaccum's, with equal random state."""
    ours = gradaccum.BatchNormalization(**config)
    theirs = keras.layers.BatchNormalization(**config)
    ours.build(input_shape)
    theirs.build(input_shape)
    rng = np.random.default_rng(seed)
    for w in theirs.weights:
        value = rng.uniform(0.5, 1.5, w.shape).astype("float32")
        w.assign(value)
        getattr(ours, w.name).assign(value)
    return ours, theirs


CONFIGS = [
    # (input shape without batch, config, masked)
    ((6,), {}, False),
    ((5, 4), {"axis": 1}, False),
    ((5, 3), {}, True),
    ((5, 3), {"axis": 1}, True),  # the mask weighs each channel apart
    ((4, 4, 3), {"momentum": 0.5}, False),
    ((3, 4, 4), {"axis": 1, "center": False}, False),
    ((2, 3, 3, 2), {"scale": False, "center": False}, False),
    ((2, 3, 3, 2), {"axis": -2, "epsilon": 1e-3}, False),
]


@pytest.mark.parametrize("shape, config, masked", CONFIGS)
def test_one_window_records_what_one_large_batch_records(shape, config, masked):
    sizes = [7, 7, 7, 3]
    micro = window_data(shape, sizes)
    masks = None
    if masked:
        rng = np.random.default_rng(5)
        masks = [rng.random((n, shape[0])) > 0.3 for n in sizes]
    ours, theirs = twin_layers(config, (None, *shape))
    # A weight on the output so that there is something to update.
    w = tf.Variable(1.0)
    opt = keras.optimizers.SGD(0.1)
    acc = gradaccum.GradientAccumulator([w], steps=len(sizes), layers=ours)
    assert acc.batch_normalization_layers == (ours,)
    for i, x in enumerate(micro):
        mask = None if masks is None else tf.constant(masks[i])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(ours(x, training=True, mask=mask) * w)
        acc.step(opt, tape.gradient(loss, [w]), weight=len(x))
        if i < len(sizes) - 1:  # nothing moves before the update
            np.testing.assert_array_equal(ours.moving_mean.numpy(), theirs.moving_mean.numpy())

    whole = np.concatenate(micro)
    mask = None if masks is None else tf.constant(np.concatenate(masks))
    theirs(whole, training=True, mask=mask)
    np.testing.assert_allclose(ours.moving_mean.numpy(), theirs.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(
        ours.moving_variance.numpy(), theirs.moving_variance.numpy(), rtol=1e-5
    )
    np.testing.assert_array_equal(ours.window_count.numpy(), 0.0)


def test_micro_batch_statistics_normalize_the_forward_pass():
    """In training each micro-batch is normalized with its own statistics, as
    Keras's layer does for that micro-batch."""
    x = window_data((4,), [6])[0]
    ours, theirs = twin_layers({}, (None, 4))
    gradaccum.GradientAccumulator([ours.gamma], layers=ours)  # drives the layer
    np.testing.assert_array_equal(ours(x, training=False), theirs(x, training=False))
    np.testing.assert_array_equal(ours(x, training=True), theirs(x, training=True))
    # Keras's layer has moved its statistics; gradaccum's waits for the update.
    assert not np.array_equal(ours.moving_mean.numpy(), theirs.moving_mean.numpy())
    np.testing.assert_array_equal(ours.micro_count.numpy(), 6.0)


def bn_model(layer_cls, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), layer_cls(momentum=0.8), keras.layers.Dense(3)]
    )


def test_fit_moves_statistics_once_per_update_with_partial_windows(door):
    """Through `wrap` or `accumulate`: 3 epochs of 7 micro-batches, steps 3 (3 + 3 + 1 flushed): the
    moving statistics equal a Keras layer fed each window as one batch."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(26, 5)) * 2 + 1).astype("float32")
    y = rng.integers(0, 3, size=26)
    model = bn_model(gradaccum.BatchNormalization)
    trainer = (gradaccum.wrap if door == "wrap" else gradaccum.accumulate)(model, steps=3)
    trainer.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = trainer.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0, 6.0, 9.0]

    reference = keras.layers.BatchNormalization(momentum=0.8)
    for _ in range(3):
        for window in (np.r_[0:12], np.r_[12:24], np.r_[24:26]):
            reference(x[window], training=True)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), reference.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), reference.moving_variance.numpy(), rtol=1e-5
    )


def test_dropped_partial_window_leaves_the_statistics_alone(door):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 5)).astype("float32")
    model = bn_model(gradaccum.BatchNormalization)
    make = gradaccum.wrap if door == "wrap" else gradaccum.accumulate
    trainer = make(model, steps=2, partial="drop")
    trainer.compile(optimizer="sgd", loss="mse")
    trainer.fit(x, np.zeros((10, 3)), batch_size=4, shuffle=False, verbose=0)
    reference = keras.layers.BatchNormalization(momentum=0.8)
    reference(x[:8], training=True)  # the window of 4 + 4; the last 2 are dropped
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), reference.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_array_equal(bn.window_count.numpy(), 0.0)


def test_undriven_layer_is_keras_batch_normalization():
    """Outside gradaccum (plain fit), the layer updates every batch, as Keras's."""
    x = window_data((5,), [8])[0]
    y = np.zeros((8, 3), "float32")
    ours, theirs = bn_model(gradaccum.BatchNormalization), bn_model(
        keras.layers.BatchNormalization
    )
    for model in (ours, theirs):
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=2, verbose=0, shuffle=False)
    for a, b in zip(theirs.weights, ours.layers[0].weights[:4] + ours.layers[1].weights):
        assert a.name == b.name
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(ours.layers[0].micro_count.numpy(), 0.0)


def test_steps_1_equals_keras_batch_normalization():
    """A window of one micro-batch: the layer and the update are Keras's."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(12, 5)) * 2 + 1).astype("float32")
    y = rng.integers(0, 3, size=12)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours, theirs = bn_model(gradaccum.BatchNormalization), bn_model(
        keras.layers.BatchNormalization
    )
    trainer = gradaccum.wrap(ours, steps=1)
    trainer.compile(optimizer="adam", loss=sce)
    trainer.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    theirs.compile(optimizer="adam", loss=sce)
    theirs.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(theirs.weights, ours.layers[0].weights[:4] + ours.layers[1].weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_after_wrap_plain_fit_sees_keras_batch_normalization():
    """`wrap` drives the layers only inside its own step."""
    x = window_data((5,), [8])[0]
    y = np.zeros((8, 3), "float32")
    model = bn_model(gradaccum.BatchNormalization)
    trainer = gradaccum.wrap(model, steps=2)
    trainer.compile(optimizer="sgd", loss="mse")
    trainer.fit(x, y, batch_size=2, verbose=0)
    bn = model.layers[0]
    before = bn.moving_mean.numpy().copy()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    reference = keras.layers.BatchNormalization(momentum=0.8)
    reference.build((None, 5))
    reference.moving_mean.assign(before)
    reference(x, training=True)
    np.testing.assert_allclose(bn.moving_mean.numpy(), reference.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(bn.micro_count.numpy(), 0.0)


def test_weight_files_move_between_keras_and_gradaccum_layers(tmp_path):
    model = bn_model(keras.layers.BatchNormalization)
    model.layers[0].moving_variance.assign(np.arange(1, 6, dtype="float32"))
    converted = gradaccum.convert_batch_normalization(model)
    x = window_data((5,), [4])[0]
    path = str(tmp_path / "converted.weights.h5")
    converted.layers[0].moving_mean.assign(np.full(5, 0.5, "float32"))
    converted.save_weights(path)
    model.load_weights(path)  # gradaccum's file into Keras's layer
    np.testing.assert_array_equal(model.predict(x, verbose=0), converted.predict(x, verbose=0))
    model.layers[0].moving_mean.assign(np.full(5, -1.0, "float32"))
    path = str(tmp_path / "keras.weights.h5")
    model.save_weights(path)
    converted.load_weights(path)  # and back
    np.testing.assert_array_equal(converted.layers[0].moving_mean.numpy(), -1.0)


def test_layer_round_trips_through_keras_saving(tmp_path):
    model = bn_model(gradaccum.BatchNormalization)
    model.layers[0].moving_mean.assign(np.arange(5, dtype="float32"))
    path = str(tmp_path / "bn.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.layers[0]
    assert type(layer) is gradaccum.BatchNormalization
    assert layer.get_config() == model.layers[0].get_config()
    x = window_data((5,), [4])[0]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


# Conversion ----------------------------------------------------------------------------


def resnet_style(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    for _ in range(2):
        r = keras.layers.Conv2D(4, 3, padding="same")(h)
        r = keras.layers.BatchNormalization(momentum=0.9)(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Conv2D(4, 3, padding="same")(r)
        r = keras.layers.BatchNormalization(center=False)(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    head = keras.Sequential(
        [keras.layers.GlobalAveragePooling2D(), keras.layers.BatchNormalization(),
         keras.layers.Dense(3)]
    )
    model = keras.Model(inputs, head(h))
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.BatchNormalization):
            for w in layer.weights:
                w.assign(rng.uniform(0.5, 1.5, w.shape).astype("float32"))
    return model


def bn_layers(model, cls):
    return [layer for layer in model._flatten_layers() if type(layer) is cls]


def test_conversion_keeps_inference_predictions_and_shares_no_variable():
    model = resnet_style()
    before = [w.numpy().copy() for w in model.weights]
    converted = gradaccum.convert_batch_normalization(model)
    assert len(bn_layers(converted, gradaccum.BatchNormalization)) == 6
    assert not bn_layers(converted, keras.layers.BatchNormalization)
    assert len(bn_layers(model, keras.layers.BatchNormalization)) == 6

    x = np.random.default_rng(3).normal(size=(5, 8, 8, 3)).astype("float32")
    np.testing.assert_array_equal(
        converted(x, training=False).numpy(), model(x, training=False).numpy()
    )
    ours = {id(v.value) for v in converted.weights}
    assert not ours & {id(v.value) for v in model.weights}

    # Training the converted model leaves the original as it was.
    trainer = gradaccum.wrap(converted, steps=2)
    trainer.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    trainer.fit(x, np.array([0, 1, 2, 0, 1]), batch_size=2, verbose=0)
    for w, w0 in zip(model.weights, before):
        np.testing.assert_array_equal(w.numpy(), w0)
    moved = bn_layers(converted, gradaccum.BatchNormalization)[0].moving_mean.numpy()
    assert not np.array_equal(moved, bn_layers(model, keras.layers.BatchNormalization)[0]
                              .moving_mean.numpy())


def test_wrap_converts_on_request():
    model = resnet_style()
    trainer = gradaccum.wrap(model, steps=2, convert_batch_norm=True)
    assert trainer.model is not model
    assert len(bn_layers(trainer.model, gradaccum.BatchNormalization)) == 6
    x = np.random.default_rng(3).normal(size=(4, 8, 8, 3)).astype("float32")
    np.testing.assert_array_equal(
        trainer.model.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    trainer.compile(optimizer="sgd", loss="mse")
    trainer.fit(x, np.zeros((4, 3)), batch_size=2, verbose=0)
    assert trainer._fit_state.accumulator.batch_normalization_layers == tuple(
        bn_layers(trainer.model, gradaccum.BatchNormalization)
    )


# Bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["renorm"])
def test_options_that_cannot_be_honoured_are_refused(option):
    with pytest.raises(ValueError) as info:
        gradaccum.BatchNormalization(**{option: True}, name="bn")
    assert str(info.value).startswith(
        f"gradaccum.BatchNormalization cannot honour `{option}=True`: "
    )
    assert f"Received: {option}=True (layer 'bn')." in str(info.value)

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization(**{option: True}, name="bn")]
    )
    with pytest.raises(ValueError, match=f"cannot honour `{option}=True`.*layer 'bn'"):
        gradaccum.wrap(model, steps=2, convert_batch_norm=True)


def test_layers_cloning_cannot_reach_are_refused():
    model = keras.Sequential(
        [
            keras.Input((4, 3)),
            keras.layers.TimeDistributed(keras.layers.BatchNormalization(name="inner")),
            keras.layers.BatchNormalization(name="outer"),
        ]
    )
    with pytest.raises(ValueError) as info:
        gradaccum.convert_batch_normalization(model)
    assert str(info.value).startswith(
        "Every BatchNormalization layer must be reachable to convert it: layers inside a "
        "wrapper or a custom layer (e.g. TimeDistributed) cannot be replaced. Received: "
    )
    assert "inside such layers" in str(info.value)


def test_subclassed_model_cannot_be_converted():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    with pytest.raises(ValueError) as info:
        gradaccum.convert_batch_normalization(Net())
    assert str(info.value) == (
        "`model` must be a Sequential or functional keras.Model to convert its "
        "BatchNormalization layers. Received: model of type Net. Build a subclassed "
        "model with `gradaccum.BatchNormalization` instead."
    )


def test_convert_batch_norm_must_be_a_bool():
    with pytest.raises(ValueError) as info:
        gradaccum.wrap(bn_model(keras.layers.BatchNormalization), 2, convert_batch_norm="yes")
    assert str(info.value) == (
        "`convert_batch_norm` must be True or False. Received: convert_batch_norm='yes'"
    )


def test_layers_must_be_keras_layers():
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator([tf.Variable(1.0)], layers=["bn"])
    assert str(info.value) == (
        "`layers` must be a Keras layer or model, or a list of them. "
        "Received: an element of type str: 'bn'"
    )


# Keras's own layer, followed through the window (core/moving_statistics.py) -----------


class TapeStep(keras.Model):
    """keras.io's TensorFlow `train_step` (GradientTape, `optimizer.apply`)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"loss": loss}


def _followed_model(cls=keras.Model, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(6, trainable=False)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.9, name="bn")(h)
    outputs = keras.layers.Dense(3)(keras.layers.Dense(4, activation="relu")(h))
    return cls(inputs, outputs)


def _followed_data(n=60):
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(n, 5)) * 3 + 1).astype("float32")
    return x, rng.integers(0, 3, size=n).astype("int32")


def test_keras_layer_follows_the_window_through_a_models_own_train_step():
    x, y = _followed_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = gradaccum.accumulate(_followed_model(TapeStep), steps=3)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference = _followed_model()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    for _ in range(2):
        for window in (np.r_[0:24], np.r_[24:48], np.r_[48:60]):
            reference.train_on_batch(x[window], y[window])
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(getattr(model.get_layer("bn"), name).numpy(),
                                   getattr(reference.get_layer("bn"), name).numpy(),
                                   rtol=1e-5, atol=1e-6)


class LateBuilt(keras.Model):
    """A subclassed model with TapeStep's `train_step`, not built before `fit`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = keras.layers.BatchNormalization(name="late_bn")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.bn(x, training=training))

    train_step = TapeStep.train_step


def test_an_own_step_model_not_built_before_fit_is_named():
    # Built by its first step, after gradaccum's state is made: its layers cannot
    # follow the window in that fit, and a warning says what to do.
    x, y = _followed_data(24)
    model = gradaccum.accumulate(LateBuilt(), steps=3)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match="layers 'late_bn' of model .* Build the model "
                      "before fit"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
