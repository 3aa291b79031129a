"""A model's own stateless `train_step` on JAX (issue 30), written as keras.io's JAX
guide writes it (`jax.value_and_grad`, `self.optimizer.stateless_apply`, the metrics
updated statelessly, the new state returned), run unchanged under `accumulate`: exact
against the same class trained on the windows."""

from __future__ import annotations

import re
import warnings

import jax
import keras
import numpy as np
import pytest
from largebatch import (
    SCE,
    assert_optimizer_close,
    assert_weights_close,
    data,
    max_gap,
    windows_of,
)

import gradaccum
from gradaccum.attach import accumulation_of


class GuideStep(keras.Model):
    """keras.io's "Customizing what happens in fit() with JAX" step, on an MLP, with
    the compiled loss and metrics."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        new_metrics_variables, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_variables)
            these = metrics_variables[start:start + len(metric.variables)]
            if metric.name == "loss":
                these = metric.stateless_update_state(these, loss)
            else:
                these = metric.stateless_update_state(these, y, y_pred)
            logs[metric.name] = metric.stateless_result(these)
            new_metrics_variables += these
        return logs, (trainable, non_trainable, optimizer_variables, new_metrics_variables)


class OwnLoss(GuideStep):
    """The same step with a loss of its own (no compiled loss): a mean over samples,
    so gradaccum weighs each micro-batch by its size."""

    def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        target = keras.ops.one_hot(y, 3)
        loss = keras.ops.mean(keras.ops.sum(keras.ops.square(y_pred - target), axis=-1))
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, (_, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {"own_loss": loss}, (trainable, non_trainable, optimizer_variables,
                                    metrics_variables)


def make(cls=GuideStep, seed=0):
    model = cls()
    model(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def _compile(model, optimizer=None, **kwargs):
    model.compile(optimizer or keras.optimizers.Adam(0.01), SCE, **kwargs)
    return model


def _reference(cls, windows, x, y, optimizer=None, **kwargs):
    """The same class without gradaccum, one step per window (its own `fit` on the
    window as one batch)."""
    reference = _compile(make(cls), optimizer, **kwargs)
    for index in windows:
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    return reference


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_the_guides_step_equals_the_class_trained_on_the_windows(name):
    # 28 samples in micro-batches of 5 (the last of 3), steps=3: windows of 15 and
    # 13 samples, the second one flushed at the end of the data; 2 epochs.
    optimizers = {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    }
    x, y = data(28)
    model = _compile(gradaccum.accumulate(make(), steps=3), optimizers[name](),
                     metrics=["accuracy"])
    history = model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    windows = windows_of([5, 5, 5, 5, 5, 3], [3, 3]) * 2
    reference = _reference(GuideStep, windows, x, y, optimizers[name](),
                           metrics=["accuracy"])
    assert max_gap(model, make()) > 1e-2
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert int(model.optimizer.iterations) == 4
    assert history.history["updates"] == [2.0, 4.0]
    assert history.history["window_micro_batches"] == [3.0, 3.0]
    # The step's own logs come through: its loss tracker and compiled metrics.
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
    # Uniform weighting is not the windows' step with these unequal micro-batches.
    uniform = _compile(gradaccum.accumulate(make(OwnLoss), steps=3, weighting="uniform"),
                       keras.optimizers.SGD(0.2))
    uniform.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert max_gap(uniform, reference) > 1e-5


def test_a_non_finite_micro_batch_of_the_own_step_is_skipped():
    x, y = data(30)
    bad = x.copy()
    bad[7, 0] = np.inf  # micro-batch 2 of window 1
    model = _compile(gradaccum.accumulate(make(), steps=3), keras.optimizers.SGD(0.2))
    with pytest.warns(UserWarning, match="skipped"):
        history = model.fit(bad, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    windows = [np.r_[0:5, 10:15], np.arange(15, 30)]
    reference = _reference(GuideStep, windows, x, y, keras.optimizers.SGD(0.2))
    assert_weights_close(model, reference)
    assert history.history["skipped"] == [1.0]


def test_save_weights_in_the_middle_of_a_window_resumes_exactly(tmp_path):
    x, y = data(30)
    path = str(tmp_path / "own.weights.h5")
    first = _compile(gradaccum.accumulate(make(), steps=3, partial="carry"))
    first.fit(x[:10], y[:10], batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(first).open_micro_batches() == 2
    first.save_weights(path)
    second = _compile(gradaccum.accumulate(make(seed=5), steps=3, partial="carry"))
    second.optimizer.build(second.trainable_variables)
    second.load_weights(path)
    assert accumulation_of(second).open_micro_batches() == 2
    second.fit(x[10:], y[10:], batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(GuideStep, [np.arange(0, 15), np.arange(15, 30)], x, y)
    assert_weights_close(second, reference)
    assert int(second.optimizer.iterations) == 2


@pytest.fixture
def carry_model():
    return _compile(gradaccum.accumulate(make(), steps=3, partial="carry"))


def test_a_window_carried_across_fits_equals_the_windows(carry_model):
    x, y = data(30)
    carry_model.fit(x[:10], y[:10], batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(carry_model).open_micro_batches() == 2
    carry_model.fit(x[10:], y[10:], batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(GuideStep, [np.arange(0, 15), np.arange(15, 30)], x, y)
    assert_weights_close(carry_model, reference)


class Delegating(keras.Sequential):
    """A step of its own that adds a log entry around Keras's."""

    def train_step(self, state, data):
        logs, state = super().train_step(state, data)
        return dict(logs, extra=1.0), state


def test_a_step_that_delegates_to_keras_default_step():
    def make_delegating():
        model = Delegating([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(3)])
        rng = np.random.default_rng(0)
        model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype)
                           for w in model.get_weights()])
        return model

    x, y = data(28)
    model = _compile(gradaccum.accumulate(make_delegating(), steps=3))
    history = model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _compile(make_delegating())
    for index in windows_of([5, 5, 5, 5, 5, 3], [3, 3]):
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    assert_weights_close(model, reference)
    assert history.history["extra"] == [1.0]
    assert history.history["updates"] == [2.0]


class TwoOptimizers(keras.Model):
    """GAN-style: two sub-networks, each with its own optimizer and loss, both
    gradients computed from the step's state before either is applied. Keras's JAX
    trainer carries `self.optimizer`'s variables; the class carries both optimizers'
    in that place of the state (its `_get_jax_state` and `jax_state_sync`), and
    hands each optimizer its slice."""

    def __init__(self):
        super().__init__()
        self.net_a = keras.Sequential(
            [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)], name="net_a"
        )
        self.net_b = keras.Sequential(
            [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)], name="net_b"
        )

    def call(self, x):
        return self.net_b(keras.ops.softmax(self.net_a(x)))

    def compile(self, opt_a, opt_b, **kwargs):
        super().compile(**kwargs)
        self.opt_a, self.opt_b = opt_a, opt_b
        opt_a.build(self.net_a.trainable_variables)
        opt_b.build(self.net_b.trainable_variables)

    def carried(self):
        return list(self.opt_a.variables) + list(self.opt_b.variables)

    def _get_jax_state(self, trainable_variables=False, non_trainable_variables=False,
                       optimizer_variables=False, metrics_variables=False,
                       purge_model_variables=False):
        state = []
        if trainable_variables:
            state.append([v.value for v in self.trainable_variables])
        if non_trainable_variables:
            state.append([v.value for v in self.non_trainable_variables])
        if optimizer_variables:
            state.append([v.value for v in self.carried()])
        if metrics_variables:
            state.append([v.value for v in self.metrics_variables])
        return tuple(state)

    def jax_state_sync(self):
        if not getattr(self, "_jax_state", None) or self._jax_state_synced:
            return
        carried = self._jax_state.pop("optimizer_variables", None) or []
        super().jax_state_sync()
        for ref, value in zip(self.carried(), carried):
            ref.assign(value)

    def losses_of(self, trainable_a, trainable_b, x, y):
        target = keras.ops.cast(keras.ops.expand_dims(y, -1), "float32")
        mapping = list(zip(self.net_a.trainable_variables, trainable_a))
        mapping += list(zip(self.net_b.trainable_variables, trainable_b))
        with keras.StatelessScope(state_mapping=mapping):
            logits = self.net_a(x, training=True)
            judged = self.net_b(keras.ops.softmax(logits), training=True)
        loss_a = keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        ) + 0.1 * keras.ops.mean(keras.ops.square(judged))
        loss_b = keras.ops.mean(keras.ops.square(judged - target))
        return loss_a, loss_b

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        n_a, n_opt_a = len(self.net_a.trainable_variables), len(self.opt_a.variables)
        trainable_a, trainable_b = trainable[:n_a], trainable[n_a:]
        loss_a, grads_a = jax.value_and_grad(
            lambda t: self.losses_of(t, trainable_b, x, y)[0])(trainable_a)
        loss_b, grads_b = jax.value_and_grad(
            lambda t: self.losses_of(trainable_a, t, x, y)[1])(trainable_b)
        trainable_a, opt_a = self.opt_a.stateless_apply(
            optimizer_variables[:n_opt_a], grads_a, trainable_a)
        trainable_b, opt_b = self.opt_b.stateless_apply(
            optimizer_variables[n_opt_a:], grads_b, trainable_b)
        return ({"loss_a": loss_a, "loss_b": loss_b},
                (list(trainable_a) + list(trainable_b), non_trainable,
                 list(opt_a) + list(opt_b), metrics_variables))


def _gan(accumulated=None):
    model = make(TwoOptimizers)
    if accumulated is not None:
        gradaccum.accumulate(model, **accumulated)
    # After accumulate: the class's own compile signature runs as written.
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    return model


@pytest.mark.parametrize("source", ["arrays", "generator"])
def test_a_gan_s_two_optimizers_each_update_once_per_window(source):
    # 28 samples in micro-batches of 4, steps=3. Arrays, 2 epochs: windows of 12, 12
    # and 4 samples an epoch. A generator of the same 14 batches is one epoch of
    # unknown length: windows of 12 samples, the last (8) applied after the data
    # ends, outside the step.
    x, y = data(28)
    model = _gan(dict(steps=3))
    if source == "arrays":
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        windows = windows_of([4] * 7, [3, 3, 1]) * 2
    else:
        def batches():
            for start in list(range(0, 28, 4)) * 2:
                yield x[start:start + 4], y[start:start + 4]

        history = model.fit(batches(), epochs=1, verbose=0)
        xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
        windows = windows_of([4] * 14, [3, 3, 3, 3, 2])
        x, y = xx, yy
    reference = _gan()
    for index in windows:
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    assert max_gap(model, make(TwoOptimizers)) > 1e-2
    assert_weights_close(model, reference)
    assert_optimizer_close(model.opt_a, reference.opt_a)
    assert_optimizer_close(model.opt_b, reference.opt_b)
    updates = len(windows)
    assert int(model.opt_a.iterations) == int(model.opt_b.iterations) == updates
    # The compiled default optimizer the class never uses stays untouched; `updates`
    # counts the first optimizer the step hands gradients to.
    assert int(model.optimizer.iterations) == 0
    assert history.history["updates"][-1] == updates
    assert {"loss_a", "loss_b"} <= set(history.history)

class DCGANOrder(TwoOptimizers):
    """keras.io's DCGAN order: the step applies `opt_a`, then differentiates
    `net_b`'s loss through `net_a`'s new weights (what `stateless_apply` returned)."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        n_a, n_opt_a = len(self.net_a.trainable_variables), len(self.opt_a.variables)
        trainable_a, trainable_b = trainable[:n_a], trainable[n_a:]
        loss_a, grads_a = jax.value_and_grad(
            lambda t: self.losses_of(t, trainable_b, x, y)[0])(trainable_a)
        trainable_a, opt_a = self.opt_a.stateless_apply(
            optimizer_variables[:n_opt_a], grads_a, trainable_a)
        loss_b, grads_b = jax.value_and_grad(
            lambda t: self.losses_of(trainable_a, t, x, y)[1])(trainable_b)
        trainable_b, opt_b = self.opt_b.stateless_apply(
            optimizer_variables[n_opt_a:], grads_b, trainable_b)
        return ({"loss_a": loss_a, "loss_b": loss_b},
                (list(trainable_a) + list(trainable_b), non_trainable,
                 list(opt_a) + list(opt_b), metrics_variables))


def _dcgan(accumulated=None):
    model = make(DCGANOrder)
    if accumulated is not None:
        gradaccum.accumulate(model, **accumulated)
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    return model


def test_at_steps_1_a_step_in_the_dcgan_order_is_plain_keras():
    # The update lands inside `stateless_apply`: the second gradient sees it.
    x, y = data(24)
    model = _dcgan(dict(steps=1))
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = _dcgan()
    reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_gap(model, make(DCGANOrder)) > 1e-2
    assert_weights_close(model, reference)
    assert_optimizer_close(model.opt_a, reference.opt_a)
    assert_optimizer_close(model.opt_b, reference.opt_b)


def test_a_due_window_lands_where_the_step_applies_it():
    # Windows of 3 micro-batches of 4: net_a's update is the window's mean gradient
    # at the window's first weights; net_b's takes its last micro-batch's gradient
    # after net_a's update (the window is due there), the others' before it.
    x, y = data(24)
    model = _dcgan(dict(steps=3))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)

    reference = _dcgan()
    n_a = len(reference.net_a.trainable_variables)

    def gradients(trainable_a, trainable_b, part):
        grad_a = jax.grad(lambda t: reference.losses_of(t, trainable_b, *part)[0])
        grad_b = jax.grad(lambda t: reference.losses_of(trainable_a, t, *part)[1])
        return grad_a(trainable_a), grad_b(trainable_b)

    for window in (range(0, 12, 4), range(12, 24, 4)):
        values = [v.value for v in reference.trainable_variables]
        a0, b0 = values[:n_a], values[n_a:]
        parts = [(x[s:s + 4], y[s:s + 4]) for s in window]
        grads_a = [gradients(a0, b0, part)[0] for part in parts]
        mean_a = [sum(g) / 3 for g in zip(*grads_a)]
        reference.opt_a.apply(mean_a, reference.net_a.trainable_variables)
        a1 = [v.value for v in reference.net_a.trainable_variables]
        grads_b = [gradients(a0, b0, part)[1] for part in parts[:2]]
        grads_b.append(gradients(a1, b0, parts[2])[1])
        mean_b = [sum(g) / 3 for g in zip(*grads_b)]
        reference.opt_b.apply(mean_b, reference.net_b.trainable_variables)
    assert_weights_close(model, reference)
    assert_optimizer_close(model.opt_a, reference.opt_a)
    assert_optimizer_close(model.opt_b, reference.opt_b)


def test_an_optimizer_swapped_in_after_the_state_was_made_is_named():
    x, y = data(8)
    model = _gan(dict(steps=2))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.opt_b = keras.optimizers.SGD(0.1)
    model.opt_b.build(model.net_b.trainable_variables)
    with pytest.raises(ValueError, match=re.escape(
        "gradaccum keeps a window for each optimizer the model holds when it is "
        "compiled. Received: `self.opt_b` in TwoOptimizers.train_step, an optimizer the "
        "model did not hold then; assign it before `compile` (or compile again)."
    )):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)


def test_a_micro_batch_both_optimizers_skip_counts_once():
    x, y = data(24)
    x[5, 0] = np.nan  # micro-batch 2 of 6: not finite for both networks
    model = _gan(dict(steps=3))
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    assert int(model.opt_a.iterations) == int(model.opt_b.iterations) == 2


class OptimizersInAList(TwoOptimizers):
    """Keeps its two optimizers in a list attribute."""

    def compile(self, opt_a, opt_b, **kwargs):
        keras.Model.compile(self, **kwargs)
        self.pair = [opt_a, opt_b]
        opt_a.build(self.net_a.trainable_variables)
        opt_b.build(self.net_b.trainable_variables)

    opt_a = property(lambda self: self.pair[0])
    opt_b = property(lambda self: self.pair[1])


def test_optimizers_kept_in_a_list_each_update_once_per_window():
    x, y = data(28)
    model = make(OptimizersInAList)
    gradaccum.accumulate(model, steps=3)
    model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = make(OptimizersInAList)
    reference.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2, momentum=0.5))
    for index in windows_of([4] * 7, [3, 3, 1]):
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    assert_weights_close(model, reference)
    assert_optimizer_close(model.opt_b, reference.opt_b)
    assert int(model.opt_a.iterations) == int(model.opt_b.iterations) == 3


def test_a_restored_window_of_an_own_step_not_run_since_is_not_applied_by_guess(tmp_path):
    # Which optimizers apply an own step's window is read from the step as it runs:
    # a window restored and flushed before any step ran must not go to the
    # compiled default optimizer the step never uses.
    x, y = data(8)
    path = str(tmp_path / "gan.weights.h5")
    first = _gan(dict(steps=3, partial="carry"))
    first.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(first).open_micro_batches() == 2
    first.save_weights(path)
    second = _gan(dict(steps=3))
    second.optimizer.build(second.trainable_variables)
    second.load_weights(path)
    before = second.get_weights()
    with pytest.warns(UserWarning, match=re.escape(
        "gradaccum cannot apply the open window (2 micro-batches) of TwoOptimizers here: "
        "which optimizers apply a model's own `train_step` is read from the step when it "
        "first runs in this process"
    )):
        gradaccum.disable(second)
    for a, b in zip(second.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert int(second.optimizer.iterations) == 0


def test_disable_after_load_applies_the_window_of_keras_default_step(tmp_path):
    x, y = data(10)
    path = str(tmp_path / "mlp.weights.h5")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model.set_weights(make().get_weights())
    _compile(gradaccum.accumulate(model, steps=3, partial="carry"))
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    model.save_weights(path)
    restored = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(3)])
    _compile(gradaccum.accumulate(restored, steps=3))
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(path)
    assert accumulation_of(restored).open_micro_batches() == 2
    gradaccum.disable(restored)
    reference = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
    reference.set_weights(make().get_weights())
    _compile(reference).fit(x, y, batch_size=10, shuffle=False, verbose=0)
    assert_weights_close(restored, reference)
    assert int(restored.optimizer.iterations) == 1


class FirstLayerFrozenByNone(GuideStep):
    """Hands `None` for the first layer's gradients (Keras's optimizer skips them)."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (_, (_, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        grads = [None, None] + list(grads[2:])
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class Clipped(GuideStep):
    """Clips its weights after the update (a WGAN critic's clip)."""

    def train_step(self, state, data):
        logs, (trainable, *rest) = super().train_step(state, data)
        trainable = [keras.ops.clip(t, -0.3, 0.3) for t in trainable]
        return logs, (trainable, *rest)


class Rematerialized(GuideStep):
    """Its loss under `jax.checkpoint`."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(jax.checkpoint(self.loss_and_updates), has_aux=True)
        (_, (_, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class OwnMetricsList(GuideStep):
    """Lists its metrics itself (keras.io's lower-level example)."""

    def __init__(self):
        super().__init__()
        self.tracker = keras.metrics.Mean(name="tracked")

    @property
    def metrics(self):
        return [self.tracker]


def test_a_rematerialized_loss_is_exact_with_a_uniform_weighting():
    x, y = data(30)
    model = _compile(gradaccum.accumulate(make(Rematerialized), steps=3,
                                          weighting="uniform"), keras.optimizers.SGD(0.2))
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(Rematerialized, windows_of([5] * 6, [3, 3]), x, y,
                           keras.optimizers.SGD(0.2))
    assert_weights_close(model, reference)


class NoApply(GuideStep):
    def train_step(self, state, data):
        return {}, state


class TwiceApplied(GuideStep):
    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (_, (_, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        for _ in range(2):
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class SecondOptimizer(GuideStep):
    """Hands its gradients to an optimizer whose variables the trainer does not
    carry (read from the optimizer at trace time)."""

    def __init__(self):
        super().__init__()
        self.other_optimizer = keras.optimizers.SGD(0.1)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        self.other_optimizer.build(self.trainable_variables)
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (_, (_, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, _ = self.other_optimizer.stateless_apply(
            [v.value for v in self.other_optimizer.variables], grads, trainable
        )
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class ComputedVariables(GuideStep):
    """Hands the optimizer values computed from the state's variables."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (_, (_, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, [t + 0.0 for t in trainable]
        )
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class OwnOptimizerChange(GuideStep):
    """Returns optimizer variables of its own making."""

    def train_step(self, state, data):
        logs, (trainable, non_trainable, optimizer_variables, metrics) = super().train_step(
            state, data)
        return logs, (trainable, non_trainable, [v + 0 for v in optimizer_variables],
                      metrics)


class OverlappingGan(TwoOptimizers):
    """Hands net_a's first variables to both optimizers."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        n_a, n_opt_a = len(self.net_a.trainable_variables), len(self.opt_a.variables)
        zeros = [keras.ops.zeros_like(t) for t in trainable]
        self.opt_a.stateless_apply(optimizer_variables[:n_opt_a], zeros[:n_a],
                                   trainable[:n_a])
        self.opt_b.stateless_apply(optimizer_variables[n_opt_a:], zeros[:2], trainable[:2])
        return {}, state


def test_none_gradients_leave_their_variables_to_keras():
    # AdamW decays every variable it receives a gradient for: the first layer's,
    # handed `None`, must stay as they are, as in Keras's own step.
    x, y = data(28)

    def adamw():
        return keras.optimizers.AdamW(0.05, weight_decay=0.5)

    model = _compile(gradaccum.accumulate(make(FirstLayerFrozenByNone), steps=3), adamw())
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _reference(FirstLayerFrozenByNone, windows_of([5, 5, 5, 5, 5, 3], [3, 3]),
                           x, y, adamw())
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    for before, after in zip(make().get_weights()[:2], model.get_weights()[:2]):
        np.testing.assert_array_equal(after, before)
    assert max_gap(model, make()) > 1e-2


def test_a_second_optimizer_that_accumulates_itself_is_refused():
    x, y = data(10)
    model = make(TwoOptimizers)
    gradaccum.accumulate(model, steps=2)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match=re.escape(
        "The optimizer must not accumulate gradients itself when gradaccum does. "
        "Received: gradient_accumulation_steps=2."
    )):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)


def test_loss_scaling_needs_the_whole_state_handed_to_the_model_optimizer():
    x, y = data(10)
    model = make(TwoOptimizers)
    gradaccum.accumulate(model, steps=2)
    model.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1),
                  optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match=re.escape(
        "On Keras's JAX backend gradaccum scales losses (a LossScaleOptimizer) for a "
        "model's own `train_step` that hands all its gradients to the model's optimizer, "
        "`self.optimizer`, with the state's optimizer variables. Received: "
        "TwoOptimizers.train_step handing them to 2 optimizer(s), a LossScaleOptimizer "
        "among them, or part of them."
    )):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)


@pytest.mark.parametrize("cls, message", [
    (NoApply, "The train_step of NoApply must hand its gradients to the model's optimizer "
              "(`self.optimizer.stateless_apply(...)`) for gradaccum to accumulate them. "
              "Received: a step that did not call it, so nothing would be trained."),
    (TwiceApplied, "On Keras's JAX backend a model's own `train_step` must hand its "
                   "gradients to `self.optimizer.stateless_apply` once per step for "
                   "gradaccum to accumulate them. Received: a second call in one step of "
                   "TwiceApplied.train_step."),
    (Clipped, "A model's own `train_step` must return the trainable variables each "
              "optimizer's `stateless_apply` gave it, unchanged, for gradaccum to apply "
              "the window's update"),
    (Rematerialized, "weighting='exact' reads each micro-batch's loss normalizer where the "
                     "compiled loss computes it; a model's own `train_step` that computes its "
                     "loss inside a JAX transformation of its own (`jax.checkpoint`, "
                     "`lax.scan`, `vmap`) keeps that value inside it. Received: a "
                     "normalizer that escaped such a transformation in "
                     "Rematerialized.train_step."),
    (OwnMetricsList, "gradaccum's state rides in the metric variables Keras's JAX trainer "
                     "carries (`model.metrics_variables`, from `model.metrics`). Received: "
                     "model"),
    (SecondOptimizer, "On Keras's JAX backend gradaccum applies each optimizer from the "
                      "state the trainer carries: a model's own `train_step` must hand "
                      "`self.other_optimizer.stateless_apply` its optimizer's variables "
                      "from the step's `state` (Keras carries `self.optimizer`'s; a model "
                      "with several optimizers carries theirs in that place, from its "
                      "`_get_jax_state`). Received: optimizer variables that are not "
                      "the state's in SecondOptimizer.train_step."),
    (ComputedVariables, "A model's own `train_step` must hand "
                        "`self.optimizer.stateless_apply` the trainable variables of the "
                        "step's `state` as it received them, for gradaccum to update them "
                        "when a window closes. Received: a value computed from them in "
                        "ComputedVariables.train_step."),
    (OverlappingGan, "Each trainable variable of a model's own `train_step` must be handed "
                     "to one optimizer. Received: variable 0 of the state handed to "
                     "`self.opt_a` and `self.opt_b` in OverlappingGan.train_step."),
    (OwnOptimizerChange, "A model's own `train_step` must return the optimizer variables "
                         "of its state as the optimizers' `stateless_apply` gave them "
                         "back: gradaccum updates them when a window closes. Received: "
                         "OwnOptimizerChange.train_step returned others"),
])
def test_a_step_that_does_not_hand_its_gradients_over_once(cls, message):
    x, y = data(10)
    if issubclass(cls, TwoOptimizers):
        model = make(cls)
        gradaccum.accumulate(model, steps=2)
        model.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    else:
        model = _compile(gradaccum.accumulate(make(cls), steps=2))
    with pytest.raises(ValueError, match=re.escape(message)):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)


def test_split_mode_with_an_own_step_is_refused():
    with pytest.raises(ValueError, match=re.escape(
        "On Keras's JAX backend a model's own `train_step` accumulates with `steps` "
        "(each batch is a micro-batch); split mode runs Keras's default step. Received: "
        "micro_batch_size=4 for model"
    )):
        gradaccum.accumulate(make(), micro_batch_size=4)


class Normalized(GuideStep):
    """The guide's step on a model with Keras's BatchNormalization after a frozen
    layer (so that the runs compared feed it the same inputs)."""

    def __init__(self):
        super().__init__()
        self.frozen = keras.layers.Dense(6, trainable=False)
        self.bn = keras.layers.BatchNormalization(momentum=0.9)

    def call(self, x, training=False):
        return self.out(self.hidden(self.bn(self.frozen(x), training=training)))


def _normalized():
    model = make(Normalized)
    model.bn.moving_variance.assign(np.ones(6, "float32"))
    return model


def test_a_batch_normalization_follows_the_window_through_the_guides_step():
    # 28 samples in micro-batches of 5 (the last of 3), steps=3, 2 epochs: the
    # moving statistics move once per window, as the class trained on the windows.
    x, y = data(28)
    x = x * 3.0 + 1.0
    model = _compile(gradaccum.accumulate(_normalized(), steps=3))
    model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    reference = _compile(_normalized())
    for index in windows_of([5, 5, 5, 5, 5, 3], [3, 3]) * 2:
        reference.fit(x[index], y[index], batch_size=len(index), shuffle=False, verbose=0)
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(np.asarray(getattr(model.bn, name)),
                                   np.asarray(getattr(reference.bn, name)),
                                   rtol=1e-5, atol=1e-6)
    assert abs(float(np.asarray(model.bn.moving_mean).max())) > 1e-2


def test_fit_says_once_that_several_optimizers_may_be_approximate():
    # JAX cannot tell from the traced step whether the second call's gradients
    # depend on the first's update (TensorFlow can): fit says so once, as audit
    # does (issue 46, item 3); a window of one micro-batch is exact.
    x, y = data(24)
    model = _dcgan(dict(steps=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "optimizers per batch" in str(w.message)]
    assert len(said) == 1
    assert said[0].startswith(
        "Accumulation is approximate for this model. The model's train_step applies 2 "
        "optimizers per batch (`self.opt_a`, `self.opt_b`)")
    model = _dcgan(dict(steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert not [w for w in caught if "approximate" in str(w.message)]


def test_a_gan_measures_the_noise_scale_of_its_updating_optimizer():
    # Two optimizers, each its own window record: each record's readings ride
    # through its own update, the logs read the first optimizer's (as `updates`),
    # and training is as without the noise scale, bit for bit.
    x, y = data(28)
    runs = []
    for noise in (False, True):
        model = _gan(dict(steps=3, noise_scale=noise))
        runs.append((model, model.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                                      verbose=0).history))
    (plain, _), (measured, history) = runs
    for a, b in zip(plain.get_weights(), measured.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(history["noise_scale"]) == 2
    named = accumulation_of(measured).saved_variables()
    # Windows of 3, 3 and 1 micro-batches an epoch: two count, in each record.
    assert [int(named[f"window_{j}_noise_windows"].numpy()) for j in (1, 2)] == [2, 2]
