"""On PyTorch: `gradaccum.wrap` (AccumulatingModel) against plain Keras on the windows,
its saving and loading in the middle of a window; `gradaccum.disable`; resuming
inside an epoch with BackupAndRestore; and `gradaccum.audit` (the cases every
backend shares, tests/audit_cases.py, and a model's own torch step)."""

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
    mlp,
    reference_fit,
    windows_of,
)

import audit_cases
import gradaccum
from audit_cases import data as audit_data
from audit_cases import (  # noqa: F401 (the audit cases every backend shares)
    everything,
    test_a_batch_normalization_that_cannot_follow_the_window_is_named_so,
    test_a_model_without_causes_is_exact_and_left_as_it_was,
    test_a_skipped_micro_batch_is_named,
    test_bad_input_is_refused,
    test_dropout_and_batch_normalization_are_named,
    test_layers_without_random_draws_are_not_named_and_listed_generators_are,
    test_mixed_precision_is_measured_against_its_own_rounding,
    test_sample_weights_and_an_own_compute_loss_are_exact,
    test_uniform_weighting_with_unequal_micro_batches_is_named,
    test_uniform_weighting_with_unequal_normalizers_is_named,
)
from gradaccum.attach import accumulation_of

# (The shared KerasHub case, `test_a_keras_hub_task_on_strings_is_exact`, takes about
# 50 s on torch's CPU: tests/torch_backend/test_torch_hub.py covers the hub tasks.)

test_a_loss_term_summed_over_the_batch_is_named = (
    audit_cases.test_a_loss_term_summed_over_the_batch_is_named)


def _trainer(steps=3, seed=0, optimizer=None, **options):
    trainer = gradaccum.wrap(mlp(seed), steps=steps, **options)
    trainer.compile(optimizer or keras.optimizers.Adam(0.05), SCE)
    return trainer


def _reference(windows, x, y, epochs=1, optimizer=None, sample_weight=None):
    reference = mlp(0)
    reference.compile(optimizer or keras.optimizers.Adam(0.05), SCE)
    return reference_fit(reference, windows, x, y, sample_weight=sample_weight, epochs=epochs)


# wrap -------------------------------------------------------------------------------------


def test_wrap_equals_plain_keras_on_the_windows():
    # 40 samples in micro-batches of 4, steps=3, 2 epochs: windows of 3, 3, 3 and
    # the flushed 1 each epoch; sample weights.
    x, y = data(40)
    sample_weight = np.linspace(0.1, 2.0, 40).astype("float32")
    inner = mlp(0)
    trainer = gradaccum.wrap(inner, steps=3)
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    # Keras's torch trainer runs one batch per call.
    assert trainer.steps_per_execution == 1
    history = trainer.fit(x, y, sample_weight=sample_weight, batch_size=4, epochs=2,
                          shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 10, [3, 3, 3, 1]), x, y, epochs=2,
                           sample_weight=sample_weight)
    assert trainer.model is inner
    assert max_gap(inner, mlp(0)) > 1e-2
    assert_weights_close(inner, reference)
    assert_optimizer_close(trainer.optimizer, reference.optimizer)
    assert history.history["updates"] == [4.0, 8.0]
    assert history.history["window_micro_batches"] == [1.0, 1.0]
    assert history.history["window_weight"] == [4.0, 4.0]
    assert int(trainer.optimizer.iterations) == 8


@pytest.mark.parametrize("partial, updates", [("drop", 3), ("carry", 6)])
def test_wrap_drops_or_carries_the_partial_window(partial, updates):
    # 10 micro-batches of 4 per epoch, steps=3, 2 epochs: "drop" loses each epoch's
    # last micro-batch; "carry" makes windows across the epochs' boundary.
    x, y = data(40)
    trainer = _trainer(steps=3, partial=partial)
    trainer.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    if partial == "drop":
        windows = windows_of([4] * 10, [3, 3, 3]) * 2
    else:
        xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
        windows = windows_of([4] * 20, [3] * 6)
    reference = mlp(0)
    reference.compile(keras.optimizers.Adam(0.05), SCE)
    if partial == "drop":
        reference_fit(reference, windows, x, y)
    else:
        reference_fit(reference, windows, xx, yy)
    assert_weights_close(trainer.model, reference)
    assert int(trainer.optimizer.iterations) == updates * (2 if partial == "drop" else 1)
    open_ = trainer._accumulation.open_micro_batches()
    assert open_ == (0 if partial == "drop" else 2)


def test_wrap_save_weights_in_the_middle_of_a_window_continues_exactly(tmp_path):
    x, y = data(40)
    full = _trainer(steps=4)
    full.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # 6 micro-batches (a window and a half) with carry, saved, loaded into a wrapper
    # of other weights and continued.
    part = _trainer(steps=4, partial="carry")
    part.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert part._accumulation.open_micro_batches() == 2
    path = str(tmp_path / "wrapped.weights.h5")
    part.save_weights(path)
    resumed = _trainer(steps=4, seed=5)
    resumed.build((None, 6))
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    assert resumed._accumulation.open_micro_batches() == 2
    resumed.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(resumed.model, full.model)
    assert_optimizer_close(resumed.optimizer, full.optimizer)
    assert int(resumed.optimizer.iterations) == 3


def test_wrapper_file_holds_the_open_window(tmp_path):
    x, y = data(40)
    full = _trainer(steps=4, partial="carry")
    full.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)

    part = _trainer(steps=4, partial="carry")
    part.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "trainer.keras")
    part.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, gradaccum.AccumulatingModel) and loaded.steps == 4
    assert loaded.partial == "carry"
    assert loaded._accumulation.open_micro_batches() == 2
    loaded.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(loaded.model, full.model)
    assert_optimizer_close(loaded.optimizer, full.optimizer)
    assert int(loaded.optimizer.iterations) == int(full.optimizer.iterations) == 2
    assert loaded._accumulation.open_micro_batches() == 2  # carried, as in `full`
    np.testing.assert_allclose(loaded.predict(x, verbose=0), full.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_the_wrapped_model_saves_as_plain_keras(tmp_path):
    x, y = data(24)
    trainer = _trainer(steps=2)
    trainer.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "inner.keras")
    trainer.model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras.Sequential
    assert accumulation_of(loaded) is None
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               trainer.model.predict(x, verbose=0), rtol=1e-6)


# disable ----------------------------------------------------------------------------------


def _accumulated(steps=3, **options):
    model = gradaccum.accumulate(mlp(0), steps=steps, **options)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    return model


@pytest.mark.parametrize("partial", ["flush", "drop", "carry"])
def test_disable_closes_the_open_window_as_partial_says(partial):
    # 5 micro-batches of 4 through `train_on_batch` (no end of data), steps=3: a
    # window of 2 stays open whatever `partial` says; `disable` applies it
    # ("flush"), discards it ("drop"), or discards it with a warning ("carry").
    x, y = data(20)
    model = _accumulated(steps=3, partial=partial)
    for start in range(0, 20, 4):
        model.train_on_batch(x[start:start + 4], y[start:start + 4])
    assert accumulation_of(model).open_micro_batches() == 2
    assert int(model.optimizer.iterations) == 1
    if partial == "carry":
        with pytest.warns(UserWarning, match=re.escape(
            "gradaccum.disable discards an open window of 2 micro-batch(es) "
            "(partial='carry' keeps windows open across fits)."
        )):
            assert gradaccum.disable(model) is model
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            assert gradaccum.disable(model) is model
    windows = windows_of([4] * 5, [3, 2] if partial == "flush" else [3])
    assert_weights_close(model, _reference(windows, x, y))
    assert int(model.optimizer.iterations) == len(windows)
    # Plain Keras afterwards: one update per batch, no gradaccum logs.
    assert accumulation_of(model) is None
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert "updates" not in history.history
    assert int(model.optimizer.iterations) == len(windows) + 5


def test_disable_refuses_a_model_not_accumulating():
    model = mlp(0)
    with pytest.raises(ValueError) as info:
        gradaccum.disable(model)
    assert str(info.value) == (
        "`model` must be a model that gradaccum accumulates for (returned by "
        f"`gradaccum.accumulate`). Received: model={model.name!r} of type Sequential"
    )


def test_disable_after_load_applies_the_open_window(tmp_path):
    x, y = data(10)
    path = str(tmp_path / "mlp.weights.h5")
    model = _accumulated(steps=3, partial="carry")
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    model.save_weights(path)
    restored = _accumulated(steps=3)
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(path)
    assert accumulation_of(restored).open_micro_batches() == 2
    gradaccum.disable(restored)
    assert_weights_close(restored, _reference([np.arange(10)], x, y))
    assert int(restored.optimizer.iterations) == 1


# BackupAndRestore -----------------------------------------------------------------------------


class GuideStep(keras.Sequential):
    """keras.io's torch step (its own `train_step`) on the largebatch MLP."""

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.zero_grad()
        loss.backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights],
                                 self.trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return self.get_metrics_result()


def _guide_step(seed=0):
    model = GuideStep([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                       keras.layers.Dense(3)])
    model.set_weights(mlp(seed).get_weights())
    return model


DOORS = {
    "wrap": lambda seed, **options: gradaccum.wrap(mlp(seed), **options),
    "own_train_step": lambda seed, **options: gradaccum.accumulate(_guide_step(seed),
                                                                    **options),
}


@pytest.mark.parametrize("partial, save_freq, stop_at",
                         [("flush", 1, (1, 1)), ("carry", "epoch", (1, 0))],
                         ids=["flush-batch-save", "carry-epoch-save"])
@pytest.mark.parametrize("door", sorted(DOORS))
def test_backup_and_restore_resumes_inside_an_epoch_exactly(tmp_path, door, partial,
                                                            save_freq, stop_at):
    # 5 micro-batches of 2 an epoch, steps=3, 3 epochs; a crash inside a window of
    # the second epoch, resumed from the backup by a model of other weights.
    x, y = data(10)
    epochs = 3

    def trainer(seed=0):
        model = DOORS[door](seed, steps=3, partial=partial)
        model.compile(keras.optimizers.Adam(0.05), SCE)
        return model

    full = trainer()
    full.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0)

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == stop_at:
                raise RuntimeError("simulated crash")

    backup = str(tmp_path / "backup")
    crashed = trainer()
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=save_freq),
                               Crash()])
    assert max_gap(crashed, full) > 1e-4

    resumed = trainer(seed=11)  # other weights: everything comes from the backup
    history = resumed.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup,
                                                                      save_freq=save_freq)])
    assert_weights_close(resumed, full, rtol=1e-6, atol=1e-7)
    assert_optimizer_close(resumed.optimizer, full.optimizer, rtol=1e-6, atol=1e-7)
    assert history.history["updates"][-1] == float(full.optimizer.iterations)


def test_backup_and_restore_equals_an_uninterrupted_run_of_the_windows(tmp_path):
    # The contract's case through `wrap`: 10 micro-batches of 4 an epoch, steps=3,
    # interrupted in the first window of the second epoch.
    x, y = data(40)

    class Counting(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.batches = getattr(self, "batches", 0) + 1
            if self.batches == 12:
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _trainer(steps=3).fit(
            x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), Counting()])
    resumed = _trainer(steps=3, seed=9)
    history = resumed.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    reference = _reference(windows_of([4] * 10, [3, 3, 3, 1]), x, y, epochs=2)
    assert_weights_close(resumed.model, reference)
    assert_optimizer_close(resumed.optimizer, reference.optimizer)
    assert history.history["updates"][-1] == 8.0


# audit ---------------------------------------------------------------------------------------


class OwnStep(keras.Sequential):
    """keras.io's torch step, with the compiled loss and metrics."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.zero_grad()
        loss.backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights],
                                 self.trainable_weights)
        return self.compute_metrics(x, y, y_pred, sample_weight)


class TwoHeads(keras.Model):
    """Two optimizers, `self.optimizer` for the body and `self.head_optimizer` for
    the head; `chained`: the head's gradient taken after the body's update."""

    def __init__(self, chained=False):
        super().__init__()
        self.chained = chained
        self.body = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.body(x))

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self.head_optimizer = keras.optimizers.SGD(0.1)

    def step_gradients(self, x, y, sample_weight, layer):
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.zero_grad()
        loss.backward()
        return [v.value.grad.clone() for v in layer.trainable_weights]

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        body = self.step_gradients(x, y, sample_weight, self.body)
        head = None if self.chained else self.step_gradients(x, y, sample_weight, self.head)
        with torch.no_grad():
            self.optimizer.apply(body, self.body.trainable_weights)
        if self.chained:
            head = self.step_gradients(x, y, sample_weight, self.head)
        with torch.no_grad():
            self.head_optimizer.apply(head, self.head.trainable_weights)
        return {}


def _seeded(model):
    model(np.zeros((1, 4), "float32"))
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


def test_audit_of_an_own_torch_step_is_exact_and_leaves_the_model_as_it_was():
    x, y = audit_data()
    model = _seeded(OwnStep([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)]))
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # moments != 0
    before = everything(model)
    sample_weight = np.linspace(0.2, 2.0, len(x)).astype("float32")
    report = gradaccum.audit(model, x, y, sample_weight=sample_weight, steps=3,
                             batch_size=10)
    assert report.exact, str(report)
    assert report.causes == []
    assert report.micro_batch_sizes == [10, 10, 10]
    assert report.max_difference < 1e-5
    assert [row[0] for row in report.rows] == [v.path for v in model.trainable_variables]
    for a, b in zip(everything(model), before):
        np.testing.assert_array_equal(a, b)
    assert accumulation_of(model) is None
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 8


OPTIMIZERS_CAUSE = (
    "The model's train_step applies 2 optimizers per batch (`self.optimizer`, "
    "`self.head_optimizer`): where a later call's gradients depend on variables an "
    "earlier call updates (a GAN's generator through its discriminator), the large "
    "batch takes them after that update and accumulation at the weights the window "
    "started from."
)


@pytest.mark.parametrize("chained", [False, True], ids=["together", "chained"])
def test_audit_names_a_step_with_two_optimizers(chained):
    # PyTorch cannot tell whether the head's gradient follows the body's update:
    # either order is reported not exact, with the two optimizers named; the
    # gradients of one window (which never closes) agree either way.
    x, y = audit_data()
    model = _seeded(TwoHeads(chained))
    model.compile(keras.optimizers.SGD(0.1), SCE)
    before = [np.array(v.numpy()) for v in model.variables]
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert not report.exact
    assert report.max_difference < 1e-5
    assert len(report.causes) == 1
    assert report.causes[0].startswith(OPTIMIZERS_CAUSE)
    assert "NOT exact" in str(report)
    for a, b in zip(model.variables, before):
        np.testing.assert_array_equal(a.numpy(), b)
    assert int(model.optimizer.iterations) == int(model.head_optimizer.iterations) == 0


def test_audit_of_a_step_applying_an_optimizer_twice_is_refused():
    class Twice(OwnStep):
        def train_step(self, data):
            x, y = data
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self.zero_grad()
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
                self.optimizer.apply(grads, self.trainable_weights)
            return {}

    x, y = audit_data()
    model = _seeded(Twice([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(keras.optimizers.SGD(0.1), SCE)
    before = model.get_weights()
    with pytest.raises(ValueError, match=re.escape(
        "A model's own `train_step` must hand its gradients to `self.optimizer.apply` "
        "once per step for gradaccum to accumulate them. Received: a second call in one "
        "step of Twice.train_step."
    )):
        gradaccum.audit(model, x, y, steps=2, batch_size=8)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert accumulation_of(model) is None

