"""What a micro-batch's forward pass moves besides the weights, on PyTorch: small
non-trainable variables put back after a skipped micro-batch, frozen weights never
copied, and wrapped torch modules with running statistics named."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import torch
from largebatch import SCE, assert_weights_close

import gradaccum
from gradaccum.backends.torch import step as torch_step
from gradaccum.core.state import LARGEST_KEPT


class Counter(keras.layers.Layer):
    """Counts the samples it sees in training (a small non-trainable variable) and
    holds a large frozen table it never changes (unless `moves_table`)."""

    def __init__(self, moves_table=False, **kwargs):
        super().__init__(**kwargs)
        self.moves_table = moves_table

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="seen")
        self.table = self.add_weight(shape=(LARGEST_KEPT + 1,), initializer="zeros",
                                     trainable=False, name="table")

    def call(self, x, training=False):
        if training:
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "float32"))
            if self.moves_table:
                self.table.assign_add(keras.ops.ones_like(self.table))
        return x


def model(moves_table=False):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), Counter(moves_table, name="counter"),
                             keras.layers.Dense(3)])


def data(n=24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    x[6] = np.nan  # micro-batch 2 of 4 (samples 4-7) is skipped
    return x, rng.integers(0, 3, n)


def test_frozen_weights_are_never_copied_and_small_state_is_put_back(monkeypatch):
    copied = []
    real = torch_step.snapshot.__wrapped__

    def counting(variables):
        copied.append(sum(int(np.prod(v.shape)) for v in variables))
        return real(variables)

    monkeypatch.setattr(torch_step, "snapshot", counting)
    trained = gradaccum.accumulate(model(), steps=3)
    trained.compile(keras.optimizers.SGD(0.1), SCE)
    x, y = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trained.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    layer = trained.get_layer("counter")
    # The skipped micro-batch's 4 samples are not counted; the table is not copied.
    assert float(layer.seen.numpy()) == 20.0
    assert copied and max(copied) < LARGEST_KEPT
    assert not any("frozen weights" in str(w.message) for w in caught)
    # The weights are those of the windows without the skipped micro-batch.
    reference = model()
    reference.compile(keras.optimizers.SGD(0.1), SCE)
    for rows in (np.r_[0:4, 8:12], np.r_[12:24]):
        reference.train_on_batch(x[rows], y[rows])
    assert_weights_close(trained, reference)


def test_a_skipped_micro_batch_that_moves_a_frozen_sized_variable_is_named():
    trained = gradaccum.accumulate(model(moves_table=True), steps=3)
    trained.compile(keras.optimizers.SGD(0.1), SCE)
    x, y = data()
    with pytest.warns(UserWarning, match=r"moved the non-trainable variable\(s\) "
                      r"'sequential/counter/table' \(65537 values\)"):
        trained.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    # Its move stays (6 micro-batches ran the layer); the small counter is put back.
    layer = trained.get_layer("counter")
    assert float(layer.table.numpy()[0]) == 6.0
    assert float(layer.seen.numpy()) == 20.0


def test_a_wrapped_torch_batch_norm_is_named_as_not_followed():
    keras.utils.set_random_seed(0)
    wrapped = keras.layers.TorchModuleWrapper(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), name="torch_bn")
    net = keras.Sequential([keras.Input((4,)), wrapped, keras.layers.Dense(3)])
    gradaccum.accumulate(net, steps=2)
    net.compile(keras.optimizers.SGD(0.1), SCE)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, 8)
    with pytest.warns(UserWarning, match="Layer 'torch_bn' wraps torch module\\(s\\) with "
                      "running statistics \\(BatchNorm1d\\)"):
        net.fit(x, y, batch_size=4, verbose=0)
    # moving_statistics="micro_batch" says the user knows: no warning.
    keras.utils.set_random_seed(0)
    other = keras.Sequential([keras.Input((4,)), keras.layers.TorchModuleWrapper(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))),
        keras.layers.Dense(3)])
    gradaccum.accumulate(other, steps=2, moving_statistics="micro_batch")
    other.compile(keras.optimizers.SGD(0.1), SCE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.fit(x, y, batch_size=4, verbose=0)
    assert not any("running statistics" in str(w.message) for w in caught)


@pytest.mark.parametrize("options", [{"steps": 2}, {"micro_batch_size": 4}])
def test_a_skipped_micro_batch_leaves_the_per_output_losses(options):
    # The compiled loss updates its per-output trackers before the screen: a skipped
    # micro-batch's nan must not reach `b_loss` (History, TerminateOnNaN).
    def two_heads():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        return keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(inputs),
                                    "b": keras.layers.Dense(1, name="b")(inputs)})

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    ya, yb = rng.normal(size=(8, 1)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    yb[5] = np.nan  # the second micro-batch of 4
    trained = gradaccum.accumulate(two_heads(), **options)
    trained.compile(keras.optimizers.SGD(0.1), {"a": "mse", "b": "mse"})
    batch = 4 if "steps" in options else 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = trained.fit(x, {"a": ya, "b": yb}, batch_size=batch, shuffle=False,
                              verbose=0)
    assert history.history["skipped"] == [1.0]
    # The first micro-batch's losses only (the model's initial weights).
    start = two_heads()
    pred = start.predict(x[:4], verbose=0)
    for name, y in (("a", ya), ("b", yb)):
        expected = float(np.mean((keras.ops.convert_to_numpy(pred[name]) - y[:4]) ** 2))
        assert history.history[f"{name}_loss"][0] == pytest.approx(expected, rel=1e-5)
