"""Nothing accumulated is lost silently (issue 57), on every backend: an optimizer's
`loss_scale_factor`, an open window through `model.save` (a `.keras` file, and so
`ModelCheckpoint`), a layer's `add_loss` summed over the batch (warned at `fit`, in
`audit`'s words), and what the `reduction` / `weighting` errors tell the user to
pass. Each case against plain Keras on the same backend trained on the windows."""

from __future__ import annotations

import types
import warnings

import keras
import numpy as np
import pytest
from largebatch import (
    SCE,
    KerasIoStep,
    assert_optimizer_close,
    assert_weights_close,
    data,
    max_gap,
    mlp,
    reference_fit,
    windows_of,
)

import gradaccum
from gradaccum import added_losses

FACTOR = 64.0
SUM_SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")


def _plain(windows, x, y, optimizer, loss=SCE, model=None):
    model = model if model is not None else mlp(0)
    model.compile(optimizer, loss)
    return reference_fit(model, windows, x, y)


# loss_scale_factor ------------------------------------------------------------------------


class ScaledStep(KerasIoStep):
    """A model with its own train_step in keras.io's pattern for its backend, which
    scales its loss as Keras's default step does (`optimizer.scale_loss`)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def _scaled_step():
    model = ScaledStep()
    model(np.zeros((1, 6), "float32"))
    model.set_weights(mlp(0).get_weights())
    return model


@pytest.mark.parametrize("path", ["default", "own_step", "split", "steps_1"])
def test_loss_scale_factor_changes_nothing(path):
    # Keras scales the loss by the factor before the backward pass and divides the
    # gradients back in `apply`: the update is the unscaled one, with and without
    # accumulation (on PyTorch gradaccum's step once left the loss unscaled: every
    # update was 1/64 of Keras's).
    x, y = data(30)
    # SGD: Adam's update hardly changes with the gradient's scale.
    scaled = lambda: keras.optimizers.SGD(0.1, loss_scale_factor=FACTOR)  # noqa: E731
    if path == "split":
        model = gradaccum.accumulate(mlp(0), micro_batch_size=4)
        model.compile(scaled(), SCE)
        model.fit(x, y, batch_size=12, shuffle=False, verbose=0)
        windows = [np.arange(0, 12), np.arange(12, 24), np.arange(24, 30)]
    else:
        steps = 1 if path == "steps_1" else 3
        model = gradaccum.accumulate(_scaled_step() if path == "own_step" else mlp(0),
                                     steps=steps)
        model.compile(scaled(), SCE)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        windows = (windows_of([4] * 7 + [2], [1] * 8) if steps == 1
                   else windows_of([4] * 7 + [2], [3, 3, 2]))
    with_factor = _plain(windows, x, y, scaled())
    without = _plain(windows, x, y, keras.optimizers.SGD(0.1))
    assert max_gap(model, mlp(0)) > 1e-2
    assert_weights_close(model, with_factor)
    assert_weights_close(model, without)
    assert int(model.optimizer.iterations) == len(windows)


def test_privacy_with_a_loss_scale_factor_is_refused():
    x, y = data(8)
    model = gradaccum.accumulate(mlp(0), steps=2, privacy=gradaccum.Privacy(1.0, 0.0, seed=1))
    model.compile(keras.optimizers.SGD(0.1, loss_scale_factor=FACTOR), SCE)
    with pytest.raises(ValueError, match="loss_scale_factor=64.0. Create the optimizer"):
        model.fit(x, y, batch_size=4, verbose=0)


# An open window through model.save ---------------------------------------------------------


def _trainer(partial, **compile_kwargs):
    model = gradaccum.accumulate(mlp(0), steps=3, partial=partial)
    model.compile(keras.optimizers.Adam(0.05), SCE, **compile_kwargs)
    return model


class SaveAt(keras.callbacks.Callback):
    """Saves the model (`model.save`, as ModelCheckpoint(save_weights_only=False)
    does) after batch `at` and stops the fit there, as a crash would."""

    def __init__(self, path, at):
        super().__init__()
        self.path, self.at = path, at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            self.model.save(self.path)
            self.model.stop_training = True


@pytest.mark.parametrize("partial", ["carry", "flush", "drop"])
def test_an_open_window_travels_in_a_keras_file(tmp_path, partial):
    # 10 micro-batches of 4 at k = 3; the save holds 5 of them (a window and 2 of
    # the next): under carry at the end of a fit on 20 samples, under flush and drop
    # in the middle of an epoch (steps_per_execution=1, a callback's save).
    x, y = data(40)
    path = str(tmp_path / "open.keras")
    full = _trainer(partial)
    full.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    if partial == "carry":
        part = _trainer(partial)
        part.fit(x[:20], y[:20], batch_size=4, shuffle=False, verbose=0)
        with pytest.warns(UserWarning, match="load the file with gradaccum.load_model"):
            part.save(path)
    else:
        part = _trainer(partial, steps_per_execution=1)
        with pytest.warns(UserWarning, match=r"open window \(2 micro-batches\)"):
            part.fit(x, y, batch_size=4, shuffle=False, verbose=0,
                     callbacks=[SaveAt(path, at=4)])
    # The file is Keras's: it loads without gradaccum (the window left out), with
    # the weights after the first window.
    plain = keras.saving.load_model(path)
    assert type(plain) is keras.Sequential
    assert_weights_close(plain, _plain(windows_of([4] * 3, [3]), x, y,
                                       keras.optimizers.Adam(0.05)))
    resumed = gradaccum.accumulate(gradaccum.load_model(path), steps=3, partial=partial)
    assert gradaccum.attach.accumulation_of(resumed).open_micro_batches() == 2
    resumed.fit(x[20:], y[20:], batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(resumed, full)
    assert_optimizer_close(resumed.optimizer, full.optimizer)
    # Without gradaccum.load_model the window is lost: the difference is real.
    lost = gradaccum.accumulate(plain, steps=3, partial=partial)
    lost.fit(x[20:], y[20:], batch_size=4, shuffle=False, verbose=0)
    assert max_gap(lost, full) > 1e-3


def test_a_keras_file_for_another_window_rule_names_the_way_out(tmp_path):
    x, y = data(20)
    model = _trainer("carry")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    path = str(tmp_path / "open.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save(path)
    with pytest.raises(ValueError, match=r"window rule \(steps=3; this model's: steps=4\)"):
        gradaccum.accumulate(gradaccum.load_model(path), steps=4, partial="carry")
    # A closed window goes on under any rule; a file saved without gradaccum loads.
    plain = mlp(0)
    plain.compile(keras.optimizers.Adam(0.05), SCE)
    plain.save(str(tmp_path / "plain.keras"))
    loaded = gradaccum.load_model(str(tmp_path / "plain.keras"))
    assert type(loaded) is keras.Sequential


def test_a_loaded_model_saved_again_before_it_trains_keeps_the_window(tmp_path):
    x, y = data(40)
    full = _trainer("carry")
    full.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    part = _trainer("carry")
    part.fit(x[:20], y[:20], batch_size=4, shuffle=False, verbose=0)
    first, second = str(tmp_path / "first.keras"), str(tmp_path / "second.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        part.save(first)
    gradaccum.load_model(first).save(second)
    resumed = gradaccum.accumulate(gradaccum.load_model(second), steps=3, partial="carry")
    assert gradaccum.attach.accumulation_of(resumed).open_micro_batches() == 2
    resumed.fit(x[20:], y[20:], batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(resumed, full)
    with pytest.warns(UserWarning, match="cannot write the open window gradaccum.load_model"):
        gradaccum.load_model(first).save(str(tmp_path / "legacy.h5"))


def test_a_loaded_open_window_fit_without_accumulate_is_warned(tmp_path):
    x, y = data(20)
    path = str(tmp_path / "open.keras")
    model = _trainer("carry")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)  # 5 micro-batches: 2 open
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save(path)
    loaded = gradaccum.load_model(path)
    with pytest.warns(UserWarning, match="`fit` without gradaccum.accumulate trains"):
        loaded.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations) == 1 + 5


def test_a_save_that_cannot_carry_the_window_warns(tmp_path):
    x, y = data(20)
    model = _trainer("carry")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match=r"cannot write the open window \(2 micro-batches\)"):
        model.save(str(tmp_path / "legacy.h5"))
    # keras.saving.save_model writes Keras's file without asking the model's save.
    with pytest.warns(UserWarning, match=r"into this file: only model.save to a local"):
        keras.saving.save_model(model, str(tmp_path / "by_keras.keras"))
    # model.save and save_weights carry it: no warning of a loss.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save_weights(str(tmp_path / "w.weights.h5"))


# add_loss summed over the batch -------------------------------------------------------------


class Penalty(keras.layers.Layer):
    """Adds `0.01 * sum(x^2)`, over the batch (`summed`) or per sample."""

    def __init__(self, summed=True, **kwargs):
        super().__init__(**kwargs)
        self.summed = summed

    def call(self, x):
        total = 0.01 * keras.ops.sum(keras.ops.square(x))
        if not self.summed:
            total = total / keras.ops.cast(keras.ops.shape(x)[0], total.dtype)
        self.add_loss(total)
        return x


def _penalized(summed, *middle):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              Penalty(summed, name="penalty"), *middle,
                              keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


def _generator(x, y, size=4):
    for start in range(0, len(x), size):
        yield x[start:start + size], y[start:start + size]


@pytest.mark.parametrize("source", ["arrays", "generator"])
def test_a_loss_summed_over_the_batch_is_warned_at_fit_in_audits_words(source):
    x, y = data(24)
    model = gradaccum.accumulate(_penalized(True), steps=3)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    given = (x, y) if source == "arrays" else (_generator(x, y),)
    with pytest.warns(UserWarning) as caught:
        model.fit(*given, batch_size=4 if source == "arrays" else None, shuffle=False,
                  verbose=0)
    said = [str(w.message) for w in caught]
    cause = added_losses.cause(model.get_layer("penalty"))
    assert said.count("Accumulation is approximate for this model. " + cause) == 1
    # The probe changed nothing: every micro-batch trained (the generator's first
    # too), as on the model trained without the check.
    quiet = gradaccum.accumulate(_penalized(True), steps=3)
    quiet.compile(keras.optimizers.SGD(0.1), SCE)
    gradaccum.attach.accumulation_of(quiet)._warned.add("added_losses")
    quiet.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(model, quiet, rtol=0, atol=0)
    assert int(model.optimizer.iterations) == 2


class Noisy(keras.utils.PyDataset):
    """Batches of 4 with NumPy's global generator's noise added (augmentation)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 4

    def __getitem__(self, i):
        part = slice(4 * i, 4 * i + 4)
        return self.x[part] + np.random.normal(size=self.x[part].shape).astype("float32"), \
            self.y[part]


@pytest.mark.parametrize("summed", [True, False])
def test_the_check_changes_no_draw_of_a_pydataset_or_its_model(summed):
    # The check calls the model on inputs of its own (not the PyDataset's: reading
    # one would move NumPy's generator its augmentation draws from), and puts back
    # every variable and random state: Dropout's masks, the moving statistics.
    x, y = data(24)
    runs = []
    for check in (True, False):
        keras.utils.set_random_seed(3)
        middle = (keras.layers.Dropout(0.3, seed=1), keras.layers.BatchNormalization())
        model = gradaccum.accumulate(_penalized(summed, *middle), steps=3)
        model.compile(keras.optimizers.SGD(0.1), SCE)
        if not check:
            gradaccum.attach.accumulation_of(model)._warned.add("added_losses")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(Noisy(x, y), epochs=2, verbose=0)
        runs.append(model)
        if check:
            said = [str(w.message) for w in caught if "(`add_loss`)" in str(w.message)]
            assert len(said) == int(summed)
    assert_weights_close(runs[0], runs[1], rtol=0, atol=0)


def test_a_loss_averaged_per_sample_is_not_warned_and_is_exact():
    x, y = data(24)
    model = gradaccum.accumulate(_penalized(False), steps=3)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    reference = _penalized(False)
    reference.compile(keras.optimizers.SGD(0.1), SCE)
    reference_fit(reference, windows_of([4] * 6, [3, 3]), x, y)
    assert_weights_close(model, reference)


# Each cause audit names is warned at fit in audit's words, or is inherent in
# micro-batches and documented (README); the counts in the words may differ (audit's
# window holds the micro-batches of one window, fit's the whole data). A model's own
# step's causes (an optimizer applied twice per batch, the DCGAN order) come from
# one function for both (`Findings.step_causes`), tested in each backend's own-step
# tests.
CAUSES = {
    "(`add_loss`) is summed over the batch": "warned at fit",
    "micro-batch(es) whose gradient is not finite": "warned at fit",
    "weighting='uniform' (micro-batches of": "warned at fit",
    "its loss terms have normalizers that are not proportional": "warned at fit",
    "draws its random numbers": "inherent",
    "each micro-batch is normalized with its own mean and variance": "inherent",
}


def _numbers_out(text):
    import re

    return re.sub(r"\d+(, \d+)*", "N", text)


def _cause_case(name):
    """`(model, x, y, fit and audit arguments)` of a model that has the cause."""
    x, y = data(30)
    kwargs = {}
    if name == "added_loss":
        model = _penalized(True)
    elif name == "inherent":
        model = _penalized(False, keras.layers.Dropout(0.3),
                           keras.layers.BatchNormalization())
    elif name == "skipped":
        model = mlp(0)
        x = x.copy()
        x[9, 0] = np.nan
    elif name == "uniform":
        model = mlp(0)
        kwargs = {"weighting": "uniform"}
    else:  # "inexact": one loss broadcast to two outputs, their sample weights unequal
        inputs = keras.Input((6,))
        model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(inputs),
                                     keras.layers.Dense(1, name="b")(inputs)])
        y = np.ones((30, 1), "float32")
        unequal = np.where(np.arange(30) < 6, 3.0, 0.2).astype("float32")
        return model, x, [y, y], {"sample_weight": [np.ones(30, "float32"), unequal]}, \
            keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    return model, x, y, kwargs, SCE


@pytest.mark.parametrize("name", ["added_loss", "inherent", "skipped", "uniform",
                                  "inexact"])
def test_each_cause_audit_names_is_warned_at_fit_or_documented_as_inherent(name):
    import pathlib

    model, x, y, kwargs, loss = _cause_case(name)
    weighting = kwargs.pop("weighting", "exact")
    model.compile(keras.optimizers.SGD(0.1), loss)
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8, weighting=weighting,
                             **kwargs)
    assert report.causes, name
    gradaccum.accumulate(model, steps=4, weighting=weighting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, **kwargs)
    said = [_numbers_out(str(w.message)) for w in caught]
    # The inherent causes are documented where the audit is (the site's page).
    audit_page = pathlib.Path(__file__).parents[2].joinpath("docs", "audit.md").read_text()
    for cause in report.causes:
        kinds = [kind for words, kind in CAUSES.items() if words in cause]
        assert len(kinds) == 1, cause
        if kinds[0] == "warned at fit":
            assert sum(_numbers_out(cause) in text for text in said) == 1, (cause, said)
        else:
            assert not any(_numbers_out(cause) in text for text in said)
    if name == "inherent":
        assert "Dropout" in audit_page and "BatchNormalization" in audit_page


# reduction and weighting ------------------------------------------------------------------


def test_a_loss_summed_over_the_batch_is_exact_with_reduction_sum():
    # Before, accumulate(reduction="sum") refused a summed loss, telling the user to
    # pass reduction="sum".
    x, y = data(30)
    model = gradaccum.accumulate(mlp(0), steps=3, reduction="sum")
    model.compile(keras.optimizers.SGD(0.01), SUM_SCE)
    history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    reference = _plain(windows_of([4] * 7 + [2], [3, 3, 2]), x, y,
                       keras.optimizers.SGD(0.01), loss=SUM_SCE)
    assert_weights_close(model, reference)
    assert history.history["window_weight"] == [6.0]


@pytest.mark.parametrize("reduction, loss_reduction, message", [
    ("mean", "sum", "For a loss summed over the batch, pass reduction='sum' to gradaccum"),
    ("mean", None, "Give the loss reduction='sum_over_batch_size' (a mean: weighted "
                   "exactly), or reduction='sum' and pass reduction='sum' to gradaccum."),
    ("sum", "none", "which returns each sample's loss"),
])
def test_a_loss_weighting_exact_cannot_weigh_says_what_to_pass(reduction, loss_reduction,
                                                               message):
    model = gradaccum.accumulate(mlp(0), steps=3, reduction=reduction)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=loss_reduction)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model.compile(keras.optimizers.SGD(0.1), loss)
    # What the message says to pass works.
    if loss_reduction == "sum":
        fixed = gradaccum.accumulate(mlp(0), steps=3, reduction="sum")
        fixed.compile(keras.optimizers.SGD(0.1), loss)
    for other in ("uniform", lambda x, y, sw: 1.0):
        ok = gradaccum.accumulate(mlp(0), steps=3, reduction=reduction, weighting=other)
        ok.compile(keras.optimizers.SGD(0.1), loss)


class HelperHeldModel(keras.Model):
    """A model's own step in keras.io's pattern that applies two optimizers: the
    model's own to its first layer, and one kept in a helper object (not an
    attribute of the model) to its second."""

    def __init__(self):
        super().__init__()
        self.first, self.second = keras.layers.Dense(2), keras.layers.Dense(1)
        self.helper = types.SimpleNamespace(optimizer=None)

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, data):
        x, y = data
        if keras.backend.backend() == "torch":
            import torch

            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            first, second = self.first.trainable_variables, self.second.trainable_variables
            self.zero_grad()
            loss.backward()
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in first], first)
                self.helper.optimizer.apply([v.value.grad for v in second], second)
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            first, second = self.first.trainable_variables, self.second.trainable_variables
            grads = tape.gradient(loss, first + second)
            self.optimizer.apply_gradients(zip(grads[:len(first)], first))
            self.helper.optimizer.apply_gradients(zip(grads[len(first):], second))
        return {"loss": loss}


@pytest.mark.skipif(keras.backend.backend() == "jax", reason=(
    "a JAX step applies an optimizer through the trainer's state, which holds only the "
    "model's own optimizers' variables"))
def test_an_optimizer_the_model_does_not_hold_is_warned_of():
    # The helper's optimizer updates at every micro-batch (it is not routed): said,
    # naming it, once per fit.
    x, y = np.ones((24, 3), "float32"), np.zeros((24, 1), "float32")
    model = gradaccum.accumulate(HelperHeldModel(), steps=3)
    model.compile(keras.optimizers.SGD(0.1))
    model.helper.optimizer = keras.optimizers.SGD(0.1, name="helper_sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "does not hold as an attribute" in str(w.message)]
    assert len(said) == 1, said
    assert "SGD optimizer ('helper_sgd')" in said[0] and "HelperHeldModel" in said[0]
    assert int(model.optimizer.iterations) == 2
    assert int(model.helper.optimizer.iterations) == 6
