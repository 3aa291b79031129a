"""A model's own `train_step` on PyTorch, written as keras.io's torch guide writes it
(`self(x, training=True)`, `self.compute_loss`, `loss.backward()`, the parameters'
`.grad` handed to `self.optimizer.apply` under `torch.no_grad()`), run unchanged under
`accumulate`: exact against the same class trained on the windows as one batch each;
a GAN's two optimizers each through its own window, applied where the step applies
it."""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest
import torch
from largebatch import (
    SCE,
    assert_optimizer_close,
    assert_weights_close,
    data,
    max_gap,
    own_loss,
    windows_of,
)

import gradaccum
from gradaccum.attach import accumulation_of


class GuideStep(keras.Model):
    """keras.io's "Customizing what happens in fit() with PyTorch" step on an MLP,
    with the compiled loss, sample weights and the compiled metrics it updates."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def gradients(self, data):
        """The step up to the optimizer: `(x, y, sample_weight, y_pred, loss, grads)`."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in self.trainable_weights]
        return x, y, sample_weight, y_pred, loss, grads

    def update_metrics(self, y, y_pred, loss, sample_weight):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            elif metric.name == "compile_metrics":
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return self.get_metrics_result()

    def train_step(self, data):
        _, y, sample_weight, y_pred, loss, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply(grads, self.trainable_weights)
        return self.update_metrics(y, y_pred, loss, sample_weight)


class OwnLoss(GuideStep):
    """The same step with a loss of its own (no compiled loss): a mean over samples,
    so gradaccum weighs each micro-batch by its size."""

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        target = keras.ops.one_hot(y, 3)
        loss = keras.ops.mean(keras.ops.sum(keras.ops.square(y_pred - target), axis=-1))
        self.zero_grad()
        loss.backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights],
                                 self.trainable_weights)
        return {"own_loss": loss.detach()}


class ByApplyGradients(GuideStep):
    """Hands its gradients over as `apply_gradients(zip(grads, variables))`."""

    def train_step(self, data):
        _, y, sample_weight, y_pred, loss, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return self.update_metrics(y, y_pred, loss, sample_weight)


class ScaledLoss(GuideStep):
    """Keras's torch step under a LossScaleOptimizer: the loss scaled before
    `backward`, the scaled gradients handed to the optimizer (which unscales)."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.zero_grad()
        self.optimizer.scale_loss(loss).backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights],
                                 self.trainable_weights)
        return self.update_metrics(y, y_pred, loss, sample_weight)


def make(cls=GuideStep, seed=0):
    model = cls()
    model(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def _compile(model, optimizer=None, **kwargs):
    model.compile(optimizer or keras.optimizers.Adam(0.01), SCE, **kwargs)
    return model


def _reference(cls, windows, x, y, optimizer=None, sample_weight=None, **kwargs):
    """The same class without gradaccum, one step per window (its own `fit` on the
    window as one batch)."""
    reference = _compile(make(cls), optimizer, **kwargs)
    for index in windows:
        weights = None if sample_weight is None else sample_weight[index]
        reference.fit(x[index], y[index], sample_weight=weights, batch_size=len(index),
                      shuffle=False, verbose=0)
    return reference


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
}


# The model's own step ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_guides_step_equals_the_class_trained_on_the_windows(name):
    # 28 samples in micro-batches of 5 (the last of 3), steps=3: windows of 15 and
    # 13 samples, the second flushed at the end of each of 2 epochs; sample weights
    # and a compiled metric the step updates itself.
    x, y = data(28)
    sample_weight = np.linspace(0.2, 2.0, 28).astype("float32")
    model = _compile(gradaccum.accumulate(make(), steps=3), OPTIMIZERS[name](),
                     metrics=["accuracy"])
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=5, epochs=2,
                        shuffle=False, verbose=0)
    reference = _reference(GuideStep, windows_of([5, 5, 5, 5, 5, 3], [3, 3]) * 2, x, y,
                           OPTIMIZERS[name](), sample_weight, metrics=["accuracy"])
    assert max_gap(model, make()) > 1e-2
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert int(model.optimizer.iterations) == 4
    assert history.history["updates"] == [2.0, 4.0]
    assert history.history["window_micro_batches"] == [3.0, 3.0]
    # The flushed window's weight: its 13 samples (the compiled loss's normalizer).
    assert history.history["window_weight"] == [13.0, 13.0]
    assert history.history["skipped"] == [0.0, 0.0]
    # The step's own logs come through: its loss tracker and compiled metric.
    assert {"loss", "accuracy"} <= set(history.history)
    assert np.isfinite(history.history["loss"]).all()


def test_a_step_with_a_loss_of_its_own_is_weighted_by_micro_batch_size():
    x, y = data(28)
    model = _compile(gradaccum.accumulate(make(OwnLoss), steps=3), keras.optimizers.SGD(0.2))
    history = model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(OwnLoss, windows_of([5, 5, 5, 5, 5, 3], [3, 3]), x, y,
                           keras.optimizers.SGD(0.2))
    assert_weights_close(model, reference)
    assert "own_loss" in history.history
    assert history.history["window_weight"] == [13.0]
    # Uniform weighting is not the windows' step with these unequal micro-batches.
    uniform = _compile(gradaccum.accumulate(make(OwnLoss), steps=3, weighting="uniform"),
                       keras.optimizers.SGD(0.2))
    uniform.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert max_gap(uniform, reference) > 1e-5


def test_a_step_handing_over_apply_gradients_equals_the_windows():
    x, y = data(28)
    model = _compile(gradaccum.accumulate(make(ByApplyGradients), steps=3),
                     keras.optimizers.Adam(0.02))
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference(ByApplyGradients, windows_of([4] * 7, [3, 3, 1]), x, y,
                           keras.optimizers.Adam(0.02))
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert history.history["updates"] == [3.0]
    assert history.history["window_micro_batches"] == [1.0]


def test_keras_step_with_an_own_compute_loss_equals_the_windows():
    # A model that overrides `compute_loss` only trains with Keras's step: its extra
    # term is taken per micro-batch and weighted as the compiled loss is.
    x, y = data(26)
    sample_weight = np.linspace(0.5, 1.5, 26).astype("float32")
    model = gradaccum.accumulate(own_loss(), steps=2)
    model.compile(keras.optimizers.SGD(0.3, momentum=0.5), SCE)
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=6, epochs=2,
                        shuffle=False, verbose=0)
    reference = own_loss()
    reference.compile(keras.optimizers.SGD(0.3, momentum=0.5), SCE)
    for index in windows_of([6, 6, 6, 6, 2], [2, 2, 1]) * 2:
        reference.train_on_batch(x[index], y[index], sample_weight=sample_weight[index])
    assert max_gap(model, own_loss()) > 1e-2
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert history.history["updates"] == [3.0, 6.0]


def test_a_window_carried_across_fits_equals_the_windows():
    x, y = data(30)
    model = _compile(gradaccum.accumulate(make(), steps=3, partial="carry"))
    model.fit(x[:10], y[:10], batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(model).open_micro_batches() == 2
    assert int(model.optimizer.iterations) == 0
    model.fit(x[10:], y[10:], batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(GuideStep, [np.arange(0, 15), np.arange(15, 30)], x, y)
    assert_weights_close(model, reference)
    assert int(model.optimizer.iterations) == 2


def test_save_weights_in_the_middle_of_a_window_resumes_exactly(tmp_path):
    x, y = data(30)
    path = str(tmp_path / "own.weights.h5")
    first = _compile(gradaccum.accumulate(make(), steps=3, partial="carry"))
    first.fit(x[:10], y[:10], batch_size=5, epochs=1, shuffle=False, verbose=0)
    first.save_weights(path)
    second = _compile(gradaccum.accumulate(make(seed=5), steps=3, partial="carry"))
    second.optimizer.build(second.trainable_variables)
    second.load_weights(path)
    assert accumulation_of(second).open_micro_batches() == 2
    second.fit(x[10:], y[10:], batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(GuideStep, [np.arange(0, 15), np.arange(15, 30)], x, y)
    assert_weights_close(second, reference)
    assert_optimizer_close(second.optimizer, reference.optimizer)


# Non-finite micro-batches and loss scaling -------------------------------------------------


class Counter(keras.layers.Layer):
    """Non-trainable variables its forward pass moves in training: the samples seen
    and the sum of their inputs."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="seen")
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="total")

    def call(self, x, training=False):
        if training:
            self.seen.assign(self.seen + keras.ops.cast(keras.ops.shape(x)[0], "float32"))
            self.total.assign(self.total + keras.ops.sum(x))
        return x


class Counted(GuideStep):
    """The guide's step with a tracker of its own (samples trained on) and a layer
    whose non-trainable variables its forward pass moves."""

    def __init__(self):
        super().__init__()
        self.counter = Counter()
        self.samples = keras.metrics.Sum(name="samples")

    def call(self, x, training=False):
        return self.out(self.hidden(self.counter(x, training=training)))

    def train_step(self, data):
        x, y, sample_weight, y_pred, loss, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply(grads, self.trainable_weights)
        self.samples.update_state(keras.ops.cast(keras.ops.shape(x)[0], "float32"))
        logs = self.update_metrics(y, y_pred, loss, sample_weight)
        return dict(logs, samples=self.samples.result())


def test_a_skipped_micro_batch_is_left_out_of_the_trackers_and_the_state():
    # Micro-batch 2 of window 1 holds an inf: skipped (warned), its window the other
    # two; the step's trackers and the counter's variables leave it out as if it
    # never ran.
    x, y = data(30)
    bad = x.copy()
    bad[7, 0] = np.inf
    model = _compile(gradaccum.accumulate(make(Counted), steps=3), keras.optimizers.SGD(0.2),
                     metrics=["accuracy"])
    model.counter.seen.assign(0.0)
    model.counter.total.assign(0.0)
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(bad, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    kept = np.r_[0:5, 10:30]
    reference = _reference(Counted, [np.r_[0:5, 10:15], np.arange(15, 30)], x, y,
                           keras.optimizers.SGD(0.2))
    for a, b in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [2.0]
    assert history.history["samples"] == [25.0]
    assert np.isfinite(history.history["loss"]).all()
    assert float(model.counter.seen.numpy()) == 25.0
    np.testing.assert_allclose(float(model.counter.total.numpy()), float(x[kept].sum()),
                               rtol=1e-5)


def test_nonfinite_raise_stops_the_own_step():
    x, y = data(10)
    x[7, 0] = np.nan
    model = _compile(gradaccum.accumulate(make(), steps=2, nonfinite="raise"))
    with pytest.raises(FloatingPointError, match="not finite"):
        model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 0


def _scaled(initial_scale=2.0**15, growth=2000):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5),
                                               initial_scale=initial_scale,
                                               dynamic_growth_steps=growth)


def test_an_own_step_that_scales_its_loss_equals_the_windows():
    # 7 micro-batches of 4 (the last of 2), steps=3; the scale is a power of two, so
    # unscaling is exact. Each finite micro-batch is one finite step of the scale's
    # count; dynamic_growth_steps=2 doubles it three times.
    x, y = data(26)
    model = _compile(gradaccum.accumulate(make(ScaledLoss), steps=3),
                     _scaled(initial_scale=8.0, growth=2))
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _compile(make(), keras.optimizers.SGD(0.5))
    for index in windows_of([4] * 6 + [2], [3, 3, 1]):
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    assert max_gap(model, make()) > 1e-2
    assert_weights_close(model, reference)
    assert history.history["updates"] == [3.0]
    assert float(model.optimizer.dynamic_scale.numpy()) == 8.0 * 2**3
    assert int(model.optimizer.inner_optimizer.iterations) == 3


def test_an_overflowing_micro_batch_of_a_scaled_own_step_halves_the_scale():
    x, y = data(24)
    x[5, 0] = np.inf  # micro-batch 2 of 6
    model = _compile(gradaccum.accumulate(make(ScaledLoss), steps=3, nonfinite="raise"),
                     _scaled(initial_scale=1024.0))
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [2.0]
    assert float(model.optimizer.dynamic_scale.numpy()) == 512.0
    # After the skip the counter restarts: micro-batches 3-6 are 4 finite steps.
    assert int(model.optimizer.step_counter.numpy()) == 4
    reference = _compile(make(), keras.optimizers.SGD(0.5))
    for index in [np.r_[0:4, 8:12], np.arange(12, 24)]:
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    assert_weights_close(model, reference)


# A GAN's two optimizers --------------------------------------------------------------------


class Gan(keras.Model):
    """keras.io's torch GAN shape: a generator and a discriminator, `compile(
    d_optimizer, g_optimizer)`, the discriminator trained first. `order="dcgan"` is
    keras.io's DCGAN order: the generator's gradient is taken through the
    discriminator after `d_optimizer.apply`; `order="together"` takes both gradients
    before either update. Deterministic: the generator's input is `x`."""

    order = "dcgan"

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential(
            [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)],
            name="generator")
        self.discriminator = keras.Sequential(
            [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)],
            name="discriminator")

    def call(self, x):
        return self.discriminator(keras.ops.softmax(self.generator(x)))

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer

    def d_loss(self, x, y):
        fake = keras.ops.softmax(self.generator(x)).detach()
        real = keras.ops.one_hot(y, 3)
        return (keras.ops.mean(keras.ops.square(self.discriminator(real) - 1.0))
                + keras.ops.mean(keras.ops.square(self.discriminator(fake))))

    def g_loss(self, x, y):
        logits = self.generator(x)
        judged = self.discriminator(keras.ops.softmax(logits))
        return keras.ops.mean(keras.ops.square(judged - 1.0)) + 0.5 * keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

    def gradients(self, loss, network):
        self.zero_grad()
        loss.backward()
        return [v.value.grad for v in network.trainable_weights]

    def train_step(self, data):
        x, y = data
        d_loss = self.d_loss(x, y)
        d_grads = self.gradients(d_loss, self.discriminator)
        if self.order == "together":
            d_grads = [g.clone() for g in d_grads]
            g_loss = self.g_loss(x, y)
            g_grads = self.gradients(g_loss, self.generator)
        with torch.no_grad():
            self.d_optimizer.apply(d_grads, self.discriminator.trainable_weights)
        if self.order == "dcgan":
            g_loss = self.g_loss(x, y)
            g_grads = self.gradients(g_loss, self.generator)
        with torch.no_grad():
            self.g_optimizer.apply(g_grads, self.generator.trainable_weights)
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}


class TogetherGan(Gan):
    order = "together"


# What fit says once of a step with several optimizers (asserted where it is the test).
APPROXIMATE = "ignore:Accumulation is approximate for this model:UserWarning"


def _gan(cls=Gan, accumulated=None):
    model = make(cls)
    if accumulated is not None:
        gradaccum.accumulate(model, **accumulated)
    # After accumulate: the class's own compile signature runs as written.
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    return model


def _assert_gans_close(model, reference):
    assert_weights_close(model, reference)
    assert_optimizer_close(model.d_optimizer, reference.d_optimizer)
    assert_optimizer_close(model.g_optimizer, reference.g_optimizer)


@pytest.mark.parametrize("source", ["arrays", "generator"])
@pytest.mark.filterwarnings(APPROXIMATE)
def test_a_gan_s_two_optimizers_each_update_once_per_window(source):
    # 28 samples in micro-batches of 4, steps=3. Arrays, 2 epochs: windows of 12, 12
    # and 4 samples an epoch (the last flushed inside the step). A generator of the
    # same 14 batches is one epoch of unknown length: windows of 12 samples, the last
    # (8) applied after the data ends, outside the step.
    x, y = data(28)
    model = _gan(TogetherGan, dict(steps=3))
    if source == "arrays":
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        windows = windows_of([4] * 7, [3, 3, 1]) * 2
    else:
        def batches():
            for start in list(range(0, 28, 4)) * 2:
                yield x[start:start + 4], y[start:start + 4]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "ran out of data"
            history = model.fit(batches(), epochs=1, shuffle=False, verbose=0)
        windows = windows_of([4] * 14, [3, 3, 3, 3, 2])
        x, y = np.concatenate([x, x]), np.concatenate([y, y])
    reference = _gan(TogetherGan)
    for index in windows:
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    assert max_gap(model, make(TogetherGan)) > 1e-2
    _assert_gans_close(model, reference)
    updates = len(windows)
    assert int(model.d_optimizer.iterations) == int(model.g_optimizer.iterations) == updates
    # The compiled default optimizer the class never uses stays untouched; `updates`
    # counts the first optimizer the step hands gradients to.
    assert int(model.optimizer.iterations) == 0
    assert history.history["updates"][-1] == updates
    assert {"d_loss", "g_loss"} <= set(history.history)


@pytest.mark.filterwarnings(APPROXIMATE)
def test_a_due_window_lands_where_the_dcgan_step_applies_it():
    # Windows of 3 micro-batches of 4: the discriminator's update is the window's
    # mean gradient at the window's first weights; the generator's takes its last
    # micro-batch's gradient through the updated discriminator (its window is due
    # there, inside the step), the others' before it.
    x, y = data(24)
    model = _gan(Gan, dict(steps=3))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)

    reference = _gan(Gan)

    def grads(loss, network):
        return [g.detach().clone() for g in reference.gradients(loss, network)]

    for window in (range(0, 12, 4), range(12, 24, 4)):
        parts = [(x[s:s + 4], y[s:s + 4]) for s in window]
        d_grads = [grads(reference.d_loss(*part), reference.discriminator) for part in parts]
        g_grads = [grads(reference.g_loss(*part), reference.generator) for part in parts[:2]]
        with torch.no_grad():
            reference.d_optimizer.apply([sum(g) / 3 for g in zip(*d_grads)],
                                        reference.discriminator.trainable_weights)
        g_grads.append(grads(reference.g_loss(*parts[2]), reference.generator))
        with torch.no_grad():
            reference.g_optimizer.apply([sum(g) / 3 for g in zip(*g_grads)],
                                        reference.generator.trainable_weights)
    assert max_gap(model, make(Gan)) > 1e-2
    _assert_gans_close(model, reference)
    assert int(model.d_optimizer.iterations) == int(model.g_optimizer.iterations) == 2
    # Not the class trained on the windows as one batch: that takes every generator
    # gradient after the discriminator's update.
    windowed = _gan(Gan)
    for index in windows_of([4] * 6, [3, 3]):
        windowed.fit(x[index], y[index], batch_size=12, shuffle=False, verbose=0)
    assert max_gap(model, windowed) > 1e-4


def test_at_steps_1_a_step_in_the_dcgan_order_is_plain_keras():
    # The update lands inside `d_optimizer.apply`: the generator's gradient sees it.
    x, y = data(24)
    model = _gan(Gan, dict(steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert not [w for w in caught if "approximate" in str(w.message)]
    reference = _gan(Gan)
    reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_gap(model, make(Gan)) > 1e-2
    _assert_gans_close(model, reference)
    assert int(model.d_optimizer.iterations) == int(model.g_optimizer.iterations) == 12


def test_fit_says_once_that_several_optimizers_may_be_approximate():
    x, y = data(24)
    model = _gan(Gan, dict(steps=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "approximate" in str(w.message)]
    assert len(said) == 1
    assert said[0].startswith(
        "Accumulation is approximate for this model. The model's train_step applies 2 "
        "optimizers per batch (`self.d_optimizer`, `self.g_optimizer`): where a later "
        "call's gradients depend on variables an earlier call updates")
    findings = accumulation_of(model).findings()
    assert findings.optimizers == ["d_optimizer", "g_optimizer"]
    assert findings.repeated == [] and findings.skipped == 0
    assert [key for key, _ in findings.step_causes()] == ["optimizers"]


@pytest.mark.filterwarnings(APPROXIMATE)
def test_a_micro_batch_both_optimizers_skip_counts_once():
    x, y = data(24)
    x[5, 0] = np.nan  # micro-batch 2 of 6: not finite for both networks
    model = _gan(TogetherGan, dict(steps=3))
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    assert int(model.d_optimizer.iterations) == int(model.g_optimizer.iterations) == 2
    reference = _gan(TogetherGan)
    for index in [np.r_[0:4, 8:12], np.arange(12, 24)]:
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    _assert_gans_close(model, reference)


@pytest.mark.filterwarnings(APPROXIMATE)
def test_a_restored_gan_window_is_not_applied_by_guess(tmp_path):
    # Which optimizers apply an own step's window is read from the step as it runs:
    # a window restored and flushed before any step ran must not go to the
    # compiled default optimizer the step never uses.
    x, y = data(8)
    path = str(tmp_path / "gan.weights.h5")
    first = _gan(Gan, dict(steps=3, partial="carry"))
    first.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(first).open_micro_batches() == 2
    first.save_weights(path)
    second = _gan(Gan, dict(steps=3))
    second.optimizer.build(second.trainable_variables)
    second.load_weights(path)
    assert accumulation_of(second).open_micro_batches() == 2
    before = second.get_weights()
    with pytest.warns(UserWarning, match=re.escape(
        "gradaccum cannot apply the open window (2 micro-batches) of Gan here: which "
        "optimizers apply a model's own `train_step` is read from the step when it "
        "first runs in this process"
    )):
        gradaccum.disable(second)
    for a, b in zip(second.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert int(second.optimizer.iterations) == 0


# Steps gradaccum cannot accumulate ------------------------------------------------------------


class NoApply(GuideStep):
    def train_step(self, data):
        self.gradients(data)
        return {}


class TwiceApplied(GuideStep):
    def train_step(self, data):
        *_, grads = self.gradients(data)
        with torch.no_grad():
            for _ in range(2):
                self.optimizer.apply(grads, self.trainable_weights)
        return {}


class TooFewGradients(GuideStep):
    def train_step(self, data):
        *_, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply(grads[:2], self.trainable_weights)
        return {}


class ForeignVariable(GuideStep):
    def __init__(self):
        super().__init__()
        self.outside = keras.Variable(np.zeros((3,), "float32"), trainable=False)

    def train_step(self, data):
        *_, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply([*grads, torch.zeros(3)],
                                 [*self.trainable_weights, self.outside])
        return {}


@pytest.mark.parametrize("cls, message", [
    (NoApply, "The train_step of NoApply must hand its gradients to the model's optimizer "
              "(`self.optimizer.apply(grads, variables)`) for gradaccum to accumulate "
              "them. Received: a step that did not call it, so nothing would be trained."),
    (TwiceApplied, "A model's own `train_step` must hand its gradients to "
                   "`self.optimizer.apply` once per step for gradaccum to accumulate them. "
                   "Received: a second call in one step of TwiceApplied.train_step."),
    (TooFewGradients, "The gradients a model's own `train_step` hands to "
                      "`self.optimizer.apply` must be one per trainable variable handed "
                      "with them. Received: 2 gradients for 4 variables in "
                      "TooFewGradients.train_step."),
    (ForeignVariable, "A model's own `train_step` must hand `self.optimizer.apply` "
                      "trainable variables of the model, for gradaccum to keep their sums. "
                      "Received: a variable the model does not train in "
                      "ForeignVariable.train_step."),
])
def test_a_step_that_does_not_hand_its_gradients_over_once_is_refused(cls, message):
    x, y = data(10)
    model = _compile(gradaccum.accumulate(make(cls), steps=2))
    before = model.get_weights()
    with pytest.raises(ValueError, match=re.escape(message)):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_split_mode_with_an_own_step_is_refused():
    with pytest.raises(ValueError, match=re.escape(
        "On Keras's PyTorch backend a model's own `train_step` accumulates with `steps` "
        "(each batch is a micro-batch); split mode runs Keras's default step. Received: "
        "micro_batch_size=4 for model"
    )) as info:
        gradaccum.accumulate(make(), micro_batch_size=4)
    assert str(info.value).endswith(
        "of class GuideStep, which defines its own `train_step`.")


def test_a_second_optimizer_that_accumulates_itself_is_refused():
    x, y = data(10)
    model = make(Gan)
    gradaccum.accumulate(model, steps=2)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match=re.escape(
        "The optimizer must not accumulate gradients itself when gradaccum does. "
        "Received: gradient_accumulation_steps=2."
    )):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)


class FirstLayerFrozenByNone(GuideStep):
    """Hands `None` for the first layer's gradients (Keras's optimizer skips them)."""

    def train_step(self, data):
        _, y, sample_weight, y_pred, loss, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply([None, None, *grads[2:]], self.trainable_weights)
        return self.update_metrics(y, y_pred, loss, sample_weight)


class OutputLayerOnly(GuideStep):
    """Hands the optimizer the output layer's variables only."""

    def train_step(self, data):
        _, y, sample_weight, y_pred, loss, grads = self.gradients(data)
        with torch.no_grad():
            self.optimizer.apply(grads[2:], self.out.trainable_weights)
        return self.update_metrics(y, y_pred, loss, sample_weight)


@pytest.mark.parametrize("cls", [FirstLayerFrozenByNone, OutputLayerOnly])
@pytest.mark.filterwarnings("ignore:Gradients do not exist for variables:UserWarning")
def test_variables_the_step_gives_no_gradient_stay_as_keras_leaves_them(cls):
    # AdamW decays every variable it receives a gradient for: the first layer's,
    # handed `None` or not handed at all, must stay as they are, as in Keras's step.
    x, y = data(28)

    def adamw():
        return keras.optimizers.AdamW(0.05, weight_decay=0.5)

    model = _compile(gradaccum.accumulate(make(cls), steps=3), adamw())
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(cls, windows_of([5, 5, 5, 5, 5, 3], [3, 3]), x, y, adamw())
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    for before, after in zip(make().get_weights()[:2], model.get_weights()[:2]):
        np.testing.assert_array_equal(after, before)
    assert max_gap(model, make()) > 1e-2
