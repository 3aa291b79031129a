"""Odd data: empty, shorter than a window, micro-batches of one, unknown batch size."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import OPTIMIZERS, fit_state, make_data, make_mlp, make_trainer

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def trained(door, x, y, steps, batch_size, partial="flush", epochs=1, data=None):
    model = make_mlp()
    trainer = make_trainer(door, model, steps=steps, partial=partial)
    trainer.compile(optimizer=OPTIMIZERS["adam"](), loss=SCE)
    if data is None:
        history = trainer.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                              verbose=0)
    else:
        history = trainer.fit(data, epochs=epochs, verbose=0)
    return model, trainer, history


def reference(x, y, windows):
    model = make_mlp()
    model.compile(optimizer=OPTIMIZERS["adam"](), loss=SCE)
    for w in windows:
        model.train_on_batch(x[w], y[w])
    return model


def assert_same_weights(a, b):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=1e-6)


EMPTY = "`fit` must receive at least one micro-batch. Received: data that yielded no "
EMPTY += "batch (an empty dataset or array), so nothing was accumulated or applied."


def test_empty_dataset_is_a_clear_error(door):
    x, y = np.zeros((0, 5), "float32"), np.zeros((0,), "int64")
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    trainer = make_trainer(door, make_mlp(), steps=2)
    trainer.compile(optimizer="sgd", loss=SCE)
    with pytest.raises(ValueError) as info:
        trainer.fit(empty, verbose=0)
    assert str(info.value) == EMPTY
    assert int(trainer.optimizer.iterations) == 0


def test_empty_data_for_an_unbuilt_model_says_so(door):
    empty = tf.data.Dataset.from_tensor_slices(
        (np.zeros((0, 5), "float32"), np.zeros((0,), "int64"))
    ).batch(4)
    trainer = make_trainer(door, keras.Sequential([keras.layers.Dense(3)], name="net"), steps=2)
    trainer.compile(optimizer="sgd", loss=SCE)
    # Built from the data's shapes first (as on TensorFlow a model with an Input
    # is), then refused as empty data is.
    with pytest.raises(ValueError) as info:
        trainer.fit(empty, verbose=0)
    assert str(info.value) == EMPTY
    assert int(trainer.optimizer.iterations) == 0


@pytest.mark.parametrize("partial, updates, open_after", [("flush", 1, 0), ("drop", 0, 0),
                                                          ("carry", 0, 3)])
def test_data_shorter_than_one_window(door, partial, updates, open_after):
    x, y = make_data(5)  # micro-batches 2, 2, 1; steps 4
    model, trainer, history = trained(door, x, y, steps=4, batch_size=2, partial=partial)
    assert history.history["updates"] == [float(updates)]
    assert int(fit_state(trainer).accumulator.micro_step) == open_after
    expected = reference(x, y, [np.arange(5)] if updates else [])
    assert_same_weights(model, expected)


def test_micro_batches_of_one_sample(door):
    x, y = make_data(7)
    model, _, history = trained(door, x, y, steps=3, batch_size=1)
    assert history.history["updates"] == [3.0]
    assert_same_weights(model, reference(x, y, [np.r_[0:3], np.r_[3:6], np.r_[6:7]]))


def test_last_micro_batch_of_one_sample(door):
    x, y = make_data(9)  # 4, 4, 1
    model, _, history = trained(door, x, y, steps=2, batch_size=4, epochs=2)
    assert history.history["updates"] == [2.0, 4.0]
    windows = [np.r_[0:8], np.r_[8:9]] * 2
    assert_same_weights(model, reference(x, y, windows))


def test_inputs_of_unknown_batch_size_and_length(door):
    """A generator dataset: no known batch dimension, no known number of batches;
    the partial window is closed when the data ends."""
    x, y = make_data(14)
    sizes = [4, 3, 4, 1, 2]  # unequal micro-batches

    def generate():
        start = 0
        for n in sizes:
            yield x[start:start + n], y[start:start + n]
            start += n

    spec = (tf.TensorSpec([None, 5], tf.float32), tf.TensorSpec([None], tf.int64))
    data = tf.data.Dataset.from_generator(generate, output_signature=spec)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model, _, history = trained(door, None, None, steps=2, batch_size=None, data=data, epochs=2)
    assert history.history["updates"] == [3.0, 6.0]
    windows = [np.r_[0:7], np.r_[7:12], np.r_[12:14]] * 2
    assert_same_weights(model, reference(x, y, windows))


def test_a_layer_used_only_in_training_of_a_model_built_by_its_first_batch_trains():
    # The model is built from the data's shapes with training=True, as Keras builds
    # it in its traced step: `aux`, called only in training, has its variables (and
    # the optimizer its slots) before the accumulators are made.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(100, 6)).astype("float32")
    y = rng.integers(0, 3, 100).astype("int32")
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    class Aux(keras.Model):
        def __init__(self):
            super().__init__()
            init = keras.initializers.RandomNormal
            self.a = keras.layers.Dense(8, "tanh", kernel_initializer=init(0, 0.5, 0))
            self.b = keras.layers.Dense(3, kernel_initializer=init(0, 0.5, 1))
            self.aux = keras.layers.Dense(3, kernel_initializer=init(0, 0.5, 2))

        def call(self, x, training=False):
            h = self.a(x)
            if training:
                self.add_loss(0.1 * keras.ops.mean(keras.ops.square(self.aux(h))))
            return self.b(h)

    reference = Aux()
    reference.compile(keras.optimizers.Adam(0.05), sce)
    for window in (slice(0, 40), slice(40, 80), slice(80, 100)):
        reference.train_on_batch(x[window], y[window])
    from gradaccum import accumulate

    model = accumulate(Aux(), steps=4)
    model.compile(keras.optimizers.Adam(0.05), sce)
    model.fit(x, y, batch_size=10, shuffle=False, verbose=0)
    assert len(model.optimizer.variables) == len(reference.optimizer.variables)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
