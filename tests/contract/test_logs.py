"""What `fit` logs when a micro-batch is skipped, on every backend (this module runs in
the TensorFlow and in the JAX process): a skipped micro-batch's loss and metrics stay
out of the trackers, so History, the progress bar and callbacks see the micro-batches
that were used; `skipped` says how many were not. With `nonfinite="apply"` the nan is
reported as it is."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from largebatch import SCE, data, mlp

import gradaccum


def _data_with_a_nan(n=32, at=9):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    x[at, 0] = np.nan  # in micro-batch 2 (of 8)
    return x, y


class _Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def _trainer(**options):
    model = gradaccum.accumulate(mlp(0), steps=2, **options)
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"],
                  steps_per_execution=1)
    return model


def _fit_past_a_nan(model, epochs):
    """Fits `model` on the data with a nan (micro-batches of 8) under
    TerminateOnNaN; returns the History and the logs callbacks saw."""
    x, y = _data_with_a_nan()
    logs = _Logs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[keras.callbacks.TerminateOnNaN(), logs])
    return history, logs


def _assert_the_skip_left_out(history, logs, epochs):
    """Every epoch ran (2 windows each, the first applied from micro-batch 1 alone),
    the logs are finite, and the skipped micro-batch (the second of each epoch)
    leaves the running loss and accuracy as the first micro-batch left them."""
    assert history.history["updates"] == [2.0 * (e + 1) for e in range(epochs)]
    assert history.history["skipped"] == [1.0 * (e + 1) for e in range(epochs)]
    for entry in logs.batches + logs.epochs:
        assert np.isfinite(entry["loss"]) and np.isfinite(entry["accuracy"]), entry
    for epoch in range(epochs):
        first, second = logs.batches[4 * epoch], logs.batches[4 * epoch + 1]
        assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)
        assert second["accuracy"] == pytest.approx(first["accuracy"], rel=1e-6)


def test_terminate_on_nan_goes_on_past_a_skipped_micro_batch():
    model = _trainer()
    history, logs = _fit_past_a_nan(model, 3)
    _assert_the_skip_left_out(history, logs, 3)
    assert np.all(np.isfinite(np.concatenate([w.ravel() for w in model.get_weights()])))


def test_monitoring_callbacks_see_the_used_micro_batches(tmp_path):
    x, y = _data_with_a_nan()
    model = _trainer()
    path = str(tmp_path / "best.weights.h5")
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=10)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=10)
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True,
                                                 save_weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                            callbacks=[early, plateau, checkpoint])
    losses = history.history["loss"]
    assert all(np.isfinite(losses))
    # A nan is never "best": the monitors tracked finite values.
    assert early.best == pytest.approx(min(losses))
    assert checkpoint.best == pytest.approx(min(losses))
    assert (tmp_path / "best.weights.h5").exists()


def test_split_mode_logs_the_used_micro_batches():
    x, y = _data_with_a_nan()
    model = gradaccum.accumulate(mlp(0), micro_batch_size=8)
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[keras.callbacks.TerminateOnNaN()])
    assert history.history["updates"] == [2.0, 4.0]
    assert all(np.isfinite(history.history["loss"]))
    assert all(np.isfinite(history.history["accuracy"]))


def test_with_nonfinite_apply_the_nan_is_reported_as_it_is():
    x, y = _data_with_a_nan()
    model = _trainer(nonfinite="apply")
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert np.isnan(history.history["loss"][0])


def _xent():
    return keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")


def _by_label(x, y, sample_weight):
    return keras.ops.sum(keras.ops.cast(y, "float32")) + 1.0


@pytest.mark.parametrize("weighting", ["exact", "uniform", _by_label])
@pytest.mark.parametrize("split", [False, True])
def test_epoch_loss_is_the_per_sample_mean_under_every_weighting(weighting, split):
    # 36 samples in micro-batches 8, 8, 8, 8, 4, with sample weights: one window per
    # epoch, so within an epoch the weights are those it started from, and plain
    # Keras on the whole batch shows the per-sample mean there (item 2 of issue 46).
    # Before, uniform and callable weightings logged the mean over micro-batches.
    x, y = _data_with_a_nan(36)
    x[9, 0] = 0.0
    sample_weight = np.random.default_rng(5).uniform(0.2, 2.0, size=36).astype("float32")
    options = {"micro_batch_size": 8} if split else {"steps": 5}
    model = gradaccum.accumulate(mlp(0), weighting=weighting, **options)
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"],
                  weighted_metrics=[_xent()], steps_per_execution=1)
    batch_size = 36 if split else 8
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=2,
                        shuffle=False, verbose=0)
    plain = mlp(0)
    plain.compile(keras.optimizers.SGD(0.0), SCE, metrics=["accuracy"],
                  weighted_metrics=[_xent()])
    expected = plain.evaluate(x, y, sample_weight=sample_weight, batch_size=36, verbose=0,
                              return_dict=True)
    for name in ("loss", "accuracy", "xent"):
        assert history.history[name][0] == pytest.approx(expected[name], rel=1e-5), name
    assert history.history["updates"] == [1.0, 2.0]


class TrackedStep(keras.Model):
    """A model with its own train_step in Keras's pattern for the backend (a tape
    and `apply_gradients` on TensorFlow, keras.io's stateless step on JAX,
    `backward()` and `optimizer.apply` on PyTorch) that
    updates the model's trackers and also logs its raw batch loss as `raw`."""

    def __init__(self, style="trackers"):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        # "trackers": Keras's metrics by their names; "raw": only the batch's
        # loss, no tracker updated; "vae": keras.io's VAE, a tracker of its own logged as "loss",
        # the accuracy in a nested dict.
        self.style = style
        if style == "vae":
            self.total = keras.metrics.Mean(name="total_loss")

    def _logs(self, loss, logs):
        if self.style == "raw":
            return {"loss": loss}
        if self.style == "vae":
            return {"raw": loss, "loss": logs["total_loss"],
                    "groups": {"accuracy": logs["accuracy"]}}
        logs["raw"] = loss
        return logs

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            return self._jax_step(*args)
        (x, y) = args[0]
        if keras.backend.backend() == "torch":
            import torch

            # keras.io's torch pattern: backward(), then apply under no_grad.
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            self.zero_grad()
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
            loss = loss.detach()
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        if self.style == "raw":
            return {"loss": loss}
        logs = {}
        for metric in self.metrics:
            if metric.name == "loss" and self.style == "vae":
                continue  # keras.io's VAE leaves Keras's loss tracker alone
            if metric.name in ("loss", "total_loss"):
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
            logs[metric.name] = metric.result()
        return self._logs(loss, logs)

    def _jax_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def objective(trainable, non_trainable):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                        training=True)
            return self.compute_loss(x, y, y_pred), (y_pred, non_trainable)

        (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(
            objective, has_aux=True)(trainable, non_trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        if self.style == "raw":
            return {"loss": loss}, (trainable, non_trainable, optimizer_variables,
                                    metrics_variables)
        new_metrics_variables, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_variables)
            these = metrics_variables[start:start + len(metric.variables)]
            if metric.name == "loss" and self.style == "vae":
                pass  # keras.io's VAE leaves Keras's loss tracker alone
            elif metric.name in ("loss", "total_loss"):
                these = metric.stateless_update_state(these, loss)
            else:
                these = metric.stateless_update_state(these, y, y_pred)
            logs[metric.name] = metric.stateless_result(these)
            new_metrics_variables += these
        return (self._logs(loss, logs),
                (trainable, non_trainable, optimizer_variables, new_metrics_variables))


def _tracked_step(nonfinite="skip", style="trackers"):
    model = TrackedStep(style)
    model(np.zeros((1, 6), "float32"))
    model.set_weights(mlp(0).get_weights())
    gradaccum.accumulate(model, steps=2, nonfinite=nonfinite)
    model.compile(keras.optimizers.Adam(0.01), SCE, steps_per_execution=1)
    return model


def test_a_models_own_step_keeps_a_skipped_micro_batch_out_of_its_trackers():
    history, logs = _fit_past_a_nan(_tracked_step(), 3)
    _assert_the_skip_left_out(history, logs, 3)
    for epoch in range(3):
        second = logs.batches[4 * epoch + 1]
        # The raw loss holds the loss tracker's moved value (nan): it reads the
        # tracker too, as the entry named after it does.
        assert second["raw"] == pytest.approx(second["loss"], rel=1e-6)
    # The epoch's loss is the mean of the three used micro-batches' losses.
    raws = [logs.batches[i]["raw"] for i in (8, 10, 11)]
    assert history.history["loss"][2] == pytest.approx(np.mean(raws), rel=1e-5)


def test_a_models_own_step_with_nonfinite_apply_reports_the_nan():
    x, y = _data_with_a_nan()
    model = _tracked_step(nonfinite="apply")
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert np.isnan(history.history["loss"][0])


def test_a_callback_list_given_to_fit_behaves_as_a_list():
    # Keras gives a caller's CallbackList no `params["steps"]`; the epoch's length
    # is still known (from Keras's epoch iterator), so the window the data ends in
    # closes in the step, as with a list (issue 46, item 4).
    from gradaccum.attach import accumulation_of

    x, y = data(28)
    lengths = []

    class Length(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            field = accumulation_of(self.model).fit_field("epoch_length")
            lengths.append(int(np.asarray(field.numpy())))

    def fitted(make_callbacks):
        model = gradaccum.accumulate(mlp(0), steps=3)
        model.compile(keras.optimizers.Adam(0.01), SCE, steps_per_execution=1)
        logs = _Logs()
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                            callbacks=make_callbacks(model, [logs, Length()]))
        return model, logs, history

    listed, listed_logs, _ = fitted(lambda model, callbacks: callbacks)
    assert lengths == [7, 7]
    lengths.clear()
    made = []

    def as_callback_list(model, callbacks):
        made.append(keras.callbacks.CallbackList(callbacks, add_history=True, model=model))
        return made[0]

    model, logs, _ = fitted(as_callback_list)
    assert lengths == [7, 7]
    assert len(made[0].callbacks) == 3  # the two given and Keras's History
    history = next(c for c in made[0].callbacks if isinstance(c, keras.callbacks.History))
    # 7 micro-batches per epoch = 3 + 3 + 1 (flushed): 3 updates per epoch.
    assert history.history["updates"] == [3.0, 6.0]
    assert int(model.optimizer.iterations) == 6
    assert [e["loss"] for e in logs.epochs] == pytest.approx(
        [e["loss"] for e in listed_logs.epochs], rel=1e-6)
    for a, b in zip(model.get_weights(), listed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_own_steps_raw_loss_is_logged_as_it_is():
    # A step that logs only its batch's loss: no tracker holds it (Keras's loss
    # tracker, named "loss" too, never moves), so the skipped micro-batch's nan is
    # logged as it is, never a made-up value.
    x, y = _data_with_a_nan()
    model = _tracked_step(style="raw")
    logs = _Logs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[logs])
    assert np.isnan(logs.batches[1]["loss"])
    assert all(np.isfinite(logs.batches[i]["loss"]) for i in (0, 2, 3))
    assert all(logs.batches[i]["loss"] != 0.0 for i in range(4))


def test_an_own_steps_tracker_under_another_name_and_nested_logs_are_kept():
    # keras.io's VAE logs its `total_loss` tracker as "loss" (here after its raw
    # loss, which comes first); the accuracy sits in a nested dict. Each reads its
    # tracker without the skipped micro-batch.
    history, logs = _fit_past_a_nan(_tracked_step(style="vae"), 2)
    assert history.history["updates"] == [2.0, 4.0]
    for epoch in range(2):
        first, second = logs.batches[4 * epoch], logs.batches[4 * epoch + 1]
        assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)
        # The raw loss holds total_loss's moved value: it reads that tracker too.
        assert second["raw"] == pytest.approx(second["loss"], rel=1e-6)
        # (Keras hands callbacks the nested entries flattened.)
        accuracy = (first["accuracy"], second["accuracy"])
        assert float(accuracy[1]) == pytest.approx(float(accuracy[0]), rel=1e-6)
    assert all(np.isfinite(e["loss"]) for e in logs.batches + logs.epochs)
