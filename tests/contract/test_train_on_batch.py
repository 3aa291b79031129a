"""`train_on_batch` under `accumulate`, on every backend: each call is one micro-batch,
a window applies when `steps` calls are in, and no call ends the data. The window a
loop of calls leaves open is closed as `partial` says by the next `fit` (before its
first batch) or by `gradaccum.end_of_data`; each against plain Keras on the windows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from largebatch import (
    SCE,
    assert_optimizer_close,
    assert_weights_close,
    data,
    mlp,
    reference_fit,
    windows_of,
)

import gradaccum


def _trainer(steps=4, **options):
    model = gradaccum.accumulate(mlp(0), steps=steps, **options)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    return model


def _reference(windows, x, y):
    model = mlp(0)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    return reference_fit(model, windows, x, y)


def _calls(model, x, y, count, start=0):
    """`count` train_on_batch calls of 4 samples from `start`; their `updates` logs."""
    updates = []
    for i in range(count):
        part = slice(start + 4 * i, start + 4 * i + 4)
        logs = model.train_on_batch(x[part], y[part], return_dict=True)
        updates.append(int(logs["updates"]))
    return updates


def test_each_call_is_a_micro_batch_and_a_window_applies_after_steps_calls():
    x, y = data(40)
    model = _trainer(steps=4)
    assert _calls(model, x, y, 10) == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    reference = _reference(windows_of([4] * 8, [4, 4]), x, y)
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert gradaccum.attach.accumulation_of(model).open_micro_batches() == 2


@pytest.mark.parametrize(
    "partial, windows, updates",
    [
        # 6 calls (a window and 2 open), then a fit of 8 micro-batches: the 2 are
        # the end of the data before the fit.
        ("flush", [4, 2, 4, 4], 4),
        ("carry", [4, 4, 4], 3),  # 2 + 2 of the fit, then 4; 2 stay open
    ],
)
def test_the_next_fit_closes_the_window_the_calls_left_open(partial, windows, updates):
    x, y = data(56)
    model = _trainer(steps=4, partial=partial)
    _calls(model, x, y, 6)
    history = model.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 14, windows), x, y)
    assert int(model.optimizer.iterations) == updates
    assert history.history["updates"] == [float(updates)]
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)


def test_drop_discards_the_window_the_calls_left_open():
    x, y = data(56)
    model = _trainer(steps=4, partial="drop")
    _calls(model, x, y, 6)
    model.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference([np.arange(0, 16), np.arange(24, 40), np.arange(40, 56)], x, y)
    assert int(model.optimizer.iterations) == 3
    assert_weights_close(model, reference)


def test_end_of_data_applies_the_open_window_as_partial_says():
    # A loop of train_on_batch calls with its own epochs: 6 calls, the end of the
    # epoch, 6 more: windows 4, 2, 4, 2.
    x, y = data(48)
    model = _trainer(steps=4)
    _calls(model, x, y, 6)
    assert gradaccum.end_of_data(model) == 2
    assert gradaccum.end_of_data(model) == 0  # nothing open: nothing applied
    _calls(model, x, y, 6, start=24)
    assert gradaccum.end_of_data(model) == 2
    reference = _reference(windows_of([4] * 12, [4, 2, 4, 2]), x, y)
    assert int(model.optimizer.iterations) == 4
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)


def test_after_end_of_data_the_next_fit_has_nothing_to_close():
    x, y = data(56)
    model = _trainer(steps=4)
    _calls(model, x, y, 6)
    gradaccum.end_of_data(model)
    model.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 14, [4, 2, 4, 4]), x, y)
    assert int(model.optimizer.iterations) == 4
    assert_weights_close(model, reference)


def test_a_fit_then_calls_then_a_fit():
    # fit closes its own partial window at its end; the calls after it start a new
    # one, which the second fit closes before its first batch.
    x, y = data(80)
    model = _trainer(steps=4)
    model.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)  # 4, 2
    _calls(model, x, y, 5, start=24)  # 4, 1 open
    model.fit(x[44:], y[44:], batch_size=4, epochs=1, shuffle=False, verbose=0)  # 4, 4, 1
    reference = _reference(windows_of([4] * 20, [4, 2, 4, 1, 4, 4, 1]), x, y)
    assert int(model.optimizer.iterations) == 7
    assert_weights_close(model, reference)


def test_end_of_data_refuses_a_model_gradaccum_does_not_accumulate_for():
    with pytest.raises(ValueError) as info:
        gradaccum.end_of_data(mlp(0))
    assert str(info.value).startswith(
        "`model` must be a model that gradaccum accumulates for (returned by "
        "`gradaccum.accumulate`). Received: model='sequential")


@pytest.mark.parametrize("round_trip", ["save_weights", "model.save"])
def test_a_window_the_calls_left_is_closed_alike_after_a_save_and_load(round_trip, tmp_path):
    # Whether the next fit closes the window is saved with it: 6 calls (2 open),
    # a save and a load, then a fit of 8 micro-batches: windows 4, 2, 4, 4 as
    # without the round trip.
    x, y = data(56)
    model = _trainer(steps=4)
    _calls(model, x, y, 6)
    if round_trip == "save_weights":
        path = str(tmp_path / "calls.weights.h5")
        model.save_weights(path)
        model.load_weights(path)
    else:
        path = str(tmp_path / "calls.keras")
        with pytest.warns(UserWarning, match="open window"):
            model.save(path)
        model = gradaccum.accumulate(gradaccum.load_model(path), steps=4)
    model.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _reference(windows_of([4] * 14, [4, 2, 4, 4]), x, y)
    assert int(model.optimizer.iterations) == 4
    assert_weights_close(model, reference)


def test_a_window_loaded_from_a_file_without_the_flag_goes_on_whatever_came_before(tmp_path):
    # A file written before the flag was saved (its key removed here), loaded into a
    # model whose own train_on_batch calls had set it: the loaded window goes on
    # into the fit, as that file's gradaccum would have it.
    x, y = data(56)
    model = _trainer(steps=4, partial="carry")
    model.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)  # 4, 2 open
    path = str(tmp_path / "carried.weights.h5")
    model.save_weights(path)
    sidecar = gradaccum.saving.sidecar(path)
    with np.load(sidecar) as store:
        kept = {k: store[k] for k in store.files if not k.endswith("outside_fit")}
    np.savez(sidecar, **kept)
    dirty = _trainer(steps=4)
    _calls(dirty, x, y, 1, start=52)
    dirty.load_weights(path)
    dirty.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    # The loaded 2 go on with the fit's first 2; its last 2 are flushed at its end.
    reference = _reference(windows_of([4] * 14, [4, 4, 4, 2]), x, y)
    assert int(dirty.optimizer.iterations) == 4
    assert_weights_close(dirty, reference)


def test_only_a_window_the_calls_left_is_saved_in_the_format_older_readers_refuse(tmp_path):
    x, y = data(24)
    model = _trainer(steps=4)
    _calls(model, x, y, 6)
    path = str(tmp_path / "calls.weights.h5")
    model.save_weights(path)
    with np.load(gradaccum.saving.sidecar(path)) as store:
        assert int(store["gradaccum@format"]) == 3
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.save_weights(path)
    with np.load(gradaccum.saving.sidecar(path)) as store:
        assert int(store["gradaccum@format"]) == 2
