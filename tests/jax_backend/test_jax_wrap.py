"""gradaccum.wrap (AccumulatingModel) on JAX: the same accumulation through a wrapper
model, whose file holds the open window."""

from __future__ import annotations

import keras
import numpy as np
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


def test_wrap_equals_plain_keras_on_the_windows():
    x, y = data(40)
    inner = mlp(0)
    trainer = gradaccum.wrap(inner, steps=3)
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    assert trainer.steps_per_execution == 3
    history = trainer.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = mlp(0)
    reference.compile(keras.optimizers.Adam(0.05), SCE)
    reference_fit(reference, windows_of([4] * 10, [3, 3, 3, 1]), x, y, epochs=2)
    assert_weights_close(inner, reference)
    assert_optimizer_close(trainer.optimizer, reference.optimizer)
    assert history.history["updates"] == [4.0, 8.0]


def test_wrapper_file_holds_the_open_window(tmp_path):
    x, y = data(40)
    full = gradaccum.wrap(mlp(0), steps=4, partial="carry")
    full.compile(keras.optimizers.Adam(0.05), SCE)
    full.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)

    part = gradaccum.wrap(mlp(0), steps=4, partial="carry")
    part.compile(keras.optimizers.Adam(0.05), SCE)
    part.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "trainer.keras")
    part.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, gradaccum.AccumulatingModel) and loaded.steps == 4
    assert loaded.partial == "carry"
    loaded.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(loaded.model, full.model)
    assert int(loaded.optimizer.iterations) == int(full.optimizer.iterations) == 2
    assert loaded._accumulation.open_micro_batches() == 2  # carried, as in `full`
    np.testing.assert_allclose(loaded.predict(x, verbose=0), full.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
