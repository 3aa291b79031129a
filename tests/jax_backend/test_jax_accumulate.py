"""gradaccum.accumulate on Keras's JAX backend, what is its own there: the errors a
jitted step records and `fit` raises after the call, and the state riding in the
trainer's state. (What holds on every backend is tests/contract/test_fit.py.)"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
from largebatch import (
    SCE,
    data,
    max_gap,
    mlp,
)

import gradaccum


def _trainer(steps=3, optimizer=None, seed=0, loss=SCE, **options):
    model = gradaccum.accumulate(mlp(seed), steps=steps, **options)
    model.compile(optimizer or keras.optimizers.Adam(0.05), loss)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_nonfinite_raise_stops_fit_naming_the_micro_batch(steps_per_execution):
    x, y = data(24)
    x[5, 0] = np.inf  # micro-batch 2, which completes the first window of 2
    model = _trainer(steps=2, nonfinite="raise", optimizer=keras.optimizers.SGD(0.5))
    model.compile(keras.optimizers.SGD(0.5), SCE, steps_per_execution=steps_per_execution)
    with pytest.raises(FloatingPointError, match=re.escape(
        "gradaccum: a gradient is not finite (inf or nan) in micro-batch 2 (counted from "
        "1; the micro-batch 2 of its window): nonfinite=raise stops here."
    )):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # Nothing after the bad micro-batch trained (not the window it completed, nor the
    # rest of its compiled call): the weights are the initial ones.
    assert int(model.optimizer.iterations) == 0
    assert max_gap(model, mlp(0)) == 0.0


def test_train_on_batch_raises_what_fit_raises():
    x, y = data(8)
    x[0, 0] = np.nan
    model = _trainer(steps=2, nonfinite="raise")
    with pytest.raises(FloatingPointError, match="micro-batch 1"):
        model.train_on_batch(x[:4], y[:4])


def test_the_state_rides_as_the_sums_and_two_vectors_and_saves_each_field(tmp_path):
    # The trainer carries one sum per trainable variable and the scalar fields packed
    # in two vectors (each array it carries costs every call); checkpoints keep one
    # entry per field, by name, and a field's view reads and writes its own place.
    x, y = data(40)
    model = _trainer(steps=4, partial="carry")
    model.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    state = gradaccum.attach.accumulation_of(model).state
    ours = [v for v in model.metrics_variables if any(v is s for s in state.variables)]
    assert len(ours) == len(model.trainable_variables) + 2
    assert int(state.micro_step.numpy()) == 2 and int(state.updates.numpy()) == 1
    assert float(state.total_weight.numpy()) == 8.0
    assert int(state.epoch_length.numpy()) == -1
    path = str(tmp_path / "fields.weights.h5")
    model.save_weights(path)
    with np.load(gradaccum.saving.sidecar(path)) as saved:
        assert int(saved["gradaccum_micro_step"]) == 2
        assert float(saved["gradaccum_total_weight"]) == 8.0
        assert int(saved["gradaccum_updates"]) == 1
        assert saved["gradaccum_accumulator_0"].shape == model.trainable_variables[0].shape
        assert "gradaccum_counts" not in saved.files
    state.error_at.assign(7)
    state.last_window_weight.assign(2.5)
    assert int(state.error_at.numpy()) == 7 and float(state.last_window_weight.numpy()) == 2.5
    assert int(state.micro_step.numpy()) == 2 and float(state.total_weight.numpy()) == 8.0


def test_a_skipped_micro_batch_leaves_the_batch_statistics_as_they_were():
    # Micro-batch 2 holds an inf: skipped, its BatchNormalization update is dropped
    # with it, so the moving statistics are those of the 5 other micro-batches (as on
    # TensorFlow: tests/contract/test_moving_statistics.py).
    x, y = data(30)
    bad = x.copy()
    bad[7, 0] = np.inf

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization(),
                                 keras.layers.Dense(3)])

    model = gradaccum.accumulate(make(), steps=1)
    model.compile(keras.optimizers.SGD(0.0), SCE)
    with pytest.warns(UserWarning, match="skipped"):
        history = model.fit(bad, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = gradaccum.accumulate(make(), steps=1)
    reference.compile(keras.optimizers.SGD(0.0), SCE)
    keep = np.r_[0:5, 10:30]
    reference.fit(x[keep], y[keep], batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    statistics = [v.numpy() for v in model.layers[0].non_trainable_variables]
    assert all(np.isfinite(s).all() for s in statistics)
    for ours, theirs in zip(statistics, reference.layers[0].non_trainable_variables):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    assert np.isfinite(model.predict(x[:4], verbose=0)).all()


# The step's error flag is read one call late (JAX's dispatch runs ahead) ---------------


def _raising_line():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    gradaccum.accumulate(model, steps=2, nonfinite="raise")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    return model, x, y


def test_an_error_in_the_epochs_last_call_is_raised_before_validation_applies_the_window():
    model, x, y = _raising_line()
    bad = x.copy()
    bad[7] = np.inf  # micro-batch 8: the second of window 4
    with pytest.raises(FloatingPointError, match="micro-batch 8 "):
        model.fit(bad, y, batch_size=1, verbose=0, shuffle=False,
                  validation_data=(x[:2], y[:2]))
    # Windows 1-3 applied; window 4 (micro-batch 7 and the bad one) was not.
    assert int(model.optimizer.iterations.numpy()) == 3


def test_a_fit_stopped_by_a_callback_leaves_no_step_error_to_the_next_fit():
    model, x, y = _raising_line()
    bad = x.copy()
    bad[3] = np.inf

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise KeyboardInterrupt

    with pytest.raises((KeyboardInterrupt, FloatingPointError)):
        model.fit(bad, y, batch_size=1, verbose=0, shuffle=False, callbacks=[Stop()])
    before = int(model.optimizer.iterations.numpy())
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False)  # clean data: no error
    # Micro-batch 3 was still open in window 2: with the 8 new ones, 9 micro-batches
    # make 4 windows of 2 and the partial one flushed at the end.
    assert int(model.optimizer.iterations.numpy()) == before + 5
