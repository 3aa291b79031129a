"""What a `fit` or `train_on_batch` under accumulation does as it starts, on every
backend: it builds a model that its first batch builds (a `Sequential` with no
`keras.Input`) as plain Keras does, and it refuses an optimizer that accumulates
gradients itself (`gradient_accumulation_steps` set after `compile`)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from largebatch import (
    SCE,
    KerasIoStep,
    assert_optimizer_close,
    assert_weights_close,
    data,
    reference_fit,
    windows_of,
)

import gradaccum

ACCUMULATES = (
    "The optimizer must not accumulate gradients itself when gradaccum does. "
    "Received: gradient_accumulation_steps=2. Create the optimizer without "
    "`gradient_accumulation_steps`."
)


def _layers(seed=0):
    """Two Dense layers whose initial weights depend only on `seed`."""
    return [
        keras.layers.Dense(8, activation="tanh",
                           kernel_initializer=keras.initializers.RandomNormal(0, 0.5, seed)),
        keras.layers.Dense(3, kernel_initializer=keras.initializers.RandomNormal(
            0, 0.5, seed + 1)),
    ]


def _unbuilt(seed=0):
    return keras.Sequential(_layers(seed))


def _reference(windows, x, y, optimizer):
    model = keras.Sequential([keras.Input((6,)), *_layers()])
    model.compile(optimizer, SCE)
    return reference_fit(model, windows, x, y)


def _fit_arrays(model, x, y):
    return model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)


def _fit_dataset(model, x, y):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    return model.fit(dataset, epochs=1, shuffle=False, verbose=0)


def _fit_repeated(model, x, y):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat()
    return model.fit(dataset, steps_per_epoch=10, epochs=1, shuffle=False, verbose=0)


def _train_on_batch(model, x, y):
    for start in range(0, 100, 10):
        model.train_on_batch(x[start:start + 10], y[start:start + 10])
    gradaccum.end_of_data(model)


FEEDS = {"arrays": _fit_arrays, "tf.data": _fit_dataset, "repeat": _fit_repeated,
         "train_on_batch": _train_on_batch}


def _exact_on_windows_4_4_2(model, x, y):
    reference = _reference(windows_of([10] * 10, [4, 4, 2]), x, y,
                           keras.optimizers.Adam(0.05))
    assert int(model.optimizer.iterations) == 3
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)


@pytest.mark.parametrize("steps_per_execution", [None, 1])
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_a_sequential_built_by_its_first_batch_trains_exactly(feed, steps_per_execution):
    # 10 micro-batches of 10 at steps=4: windows 4, 4, 2.
    x, y = data(100)
    model = gradaccum.accumulate(_unbuilt(), steps=4)
    per_call = {} if steps_per_execution is None else {
        "steps_per_execution": steps_per_execution}
    model.compile(keras.optimizers.Adam(0.05), SCE, **per_call)
    assert not model.built
    FEEDS[feed](model, x, y)
    _exact_on_windows_4_4_2(model, x, y)


def test_wrap_of_a_sequential_built_by_its_first_batch_trains_exactly():
    x, y = data(100)
    model = gradaccum.wrap(_unbuilt(), steps=4)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    _fit_arrays(model, x, y)
    _exact_on_windows_4_4_2(model, x, y)


def test_a_sequential_built_by_its_first_batch_in_split_mode():
    x, y = data(100)
    model = gradaccum.accumulate(_unbuilt(), micro_batch_size=10)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    reference = _reference(windows_of([40, 40, 20], [1, 1, 1]), x, y,
                           keras.optimizers.Adam(0.05))
    assert int(model.optimizer.iterations) == 3
    assert_weights_close(model, reference)


def _seeded_shuffle(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(100, seed=7).batch(10)


def _one_shot(x, y):
    batches = iter([(x[i:i + 10], y[i:i + 10]) for i in range(0, 100, 10)])
    return tf.data.Dataset.from_generator(
        lambda: batches, output_signature=(tf.TensorSpec((None, 6), "float32"),
                                           tf.TensorSpec((None,), "int32")))


@pytest.mark.parametrize("source", [_seeded_shuffle, _one_shot])
def test_the_build_reads_no_batch_of_the_data(source):
    # A model built by its first batch trains on what a built one trains on: the
    # build reads the data's shapes, not a batch (a seeded shuffle's first order, a
    # one-shot generator's every batch).
    if source is _one_shot and keras.backend.backend() != "tensorflow":
        pytest.skip("Keras's JAX and PyTorch trainers read the first batch to build an "
                    "unbuilt model, plain fit alike")
    x, y = data(100)
    models = []
    for first in (_unbuilt(), keras.Sequential([keras.Input((6,)), *_layers()])):
        model = gradaccum.accumulate(first, steps=4)
        model.compile(keras.optimizers.Adam(0.05), SCE)
        history = model.fit(source(x, y), epochs=1, shuffle=False, verbose=0)
        assert history.history["updates"] == [3.0]
        models.append(model)
    assert_weights_close(*models)


def _compiled(model=None):
    model = gradaccum.accumulate(model or keras.Sequential(
        [keras.Input((6,)), *_layers()]), steps=2)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    return model


def _refused(model, run):
    """`run(model)` with `gradient_accumulation_steps` set after compile raises the
    compile-time message and changes no weight."""
    model.optimizer.gradient_accumulation_steps = 2
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(ValueError) as info:
        run(model)
    assert str(info.value) == ACCUMULATES
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_gradient_accumulation_steps_set_after_compile_is_refused_by_fit():
    x, y = data(40)
    _refused(_compiled(), lambda m: m.fit(x, y, batch_size=10, verbose=0))


def test_gradient_accumulation_steps_set_after_compile_is_refused_by_train_on_batch():
    x, y = data(40)
    _refused(_compiled(), lambda m: m.train_on_batch(x[:10], y[:10]))


def test_gradient_accumulation_steps_set_after_a_fit_is_refused_by_the_next():
    x, y = data(40)
    model = _compiled()
    model.fit(x, y, batch_size=10, verbose=0)
    _refused(model, lambda m: m.fit(x, y, batch_size=10, verbose=0))


class _OwnStep(KerasIoStep):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = _layers()

    def call(self, x):
        return self.out(self.hidden(x))


def test_gradient_accumulation_steps_set_after_compile_is_refused_for_an_own_step():
    x, y = data(40)
    model = _OwnStep()
    model(x[:1])
    _refused(_compiled(model), lambda m: m.fit(x, y, batch_size=10, verbose=0))


def test_gradient_accumulation_steps_set_after_compile_is_refused_by_wrap():
    x, y = data(40)
    model = gradaccum.wrap(keras.Sequential([keras.Input((6,)), *_layers()]), steps=2)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    _refused(model, lambda m: m.fit(x, y, batch_size=10, verbose=0))
