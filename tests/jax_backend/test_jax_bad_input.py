"""What gradaccum refuses on JAX, each with its fixed-form message."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
from largebatch import SCE, data, mlp

import gradaccum


def test_a_schedule_callable_jax_cannot_trace():
    def python_if(update_index):
        return 1 if update_index < 2 else 4

    with pytest.raises(ValueError, match=re.escape(
        "The `steps` callable must be traceable by JAX: written with `keras.ops` / "
        "`jax.numpy` (`jnp.where` rather than a Python `if` on the update index). "
        "Received: a callable that failed on a traced update index: "
        "TracerBoolConversionError"
    )):
        gradaccum.accumulate(mlp(), steps=python_if)


def test_a_schedule_callable_of_zero_or_a_float():
    with pytest.raises(ValueError, match=re.escape(
        "The `steps` callable must return an integer >= 1. Received: 0 for update_index=0"
    )):
        gradaccum.accumulate(mlp(), steps=lambda i: i * 0)
    with pytest.raises(ValueError, match=re.escape(
        "The `steps` callable must return an integer >= 1. Received: a value of dtype float32"
    )):
        gradaccum.accumulate(mlp(), steps=lambda i: keras.ops.cast(i, "float32") + 1.5)


def test_a_schedule_that_later_returns_zero_raises_at_its_window():
    x, y = data(24)
    model = gradaccum.accumulate(
        mlp(), steps=lambda i: keras.ops.where(i < 2, 2, 0)
    )
    model.compile("sgd", SCE)
    with pytest.raises(ValueError, match=re.escape(
        "The `steps` callable must return an integer >= 1. Received: a value < 1 for "
        "update_index=2"
    )):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)


def test_a_negative_weight_from_the_weighting_callable():
    x, y = data(24)
    model = gradaccum.accumulate(mlp(), steps=2, weighting=lambda x, y, sw: -1.0)
    model.compile("sgd", SCE)
    with pytest.raises(ValueError, match=re.escape(
        "The `weighting` callable must return a weight >= 0. Received: a negative or nan "
        "weight for micro-batch 1 of its window"
    )):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("name", ["CountingCrossDeviceOps", "BatchNormalization"])
def test_tensorflow_only_names_say_where_they_run(name):
    gradaccum.__dict__.pop(name, None)
    with pytest.raises(ImportError, match=re.escape(
        f"gradaccum.{name} runs on Keras's TensorFlow backend. Received: "
        "keras.backend.backend()='jax'. On JAX, use gradaccum.accumulate(model, "
        "steps=...) with the model's own fit (or gradaccum.wrap), or set "
        "KERAS_BACKEND=tensorflow before Keras is imported."
    )):
        getattr(gradaccum, name)


def test_every_option_of_the_catalogue_is_checked_as_on_tensorflow():
    cases = [
        (dict(steps=0), "`steps` must be"),
        (dict(steps=2, partial="later"), "`partial` must be one of 'flush', 'carry', 'drop'"),
        (dict(steps=2, reduction="max"), "`reduction` must be one of 'mean', 'sum'"),
        (dict(steps=2, weighting="tokens"), "`weighting` must be one of"),
        (dict(steps=2, nonfinite="ignore"), "`nonfinite` must be one of"),
        (dict(steps=2, accumulator_dtype="int32"), "`accumulator_dtype` must be a floating"),
        (dict(steps=2, weight_per_update=4), "`steps` and `weight_per_update` cannot"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            gradaccum.accumulate(mlp(), **options)
    assert np.isfinite(1.0)


def test_float64_accumulators_need_jax_x64():
    with pytest.raises(ValueError, match=re.escape(
        "`accumulator_dtype` must be a dtype JAX computes in: float64 needs "
        "jax.config.update('jax_enable_x64', True)"
    )):
        gradaccum.accumulate(mlp(), steps=2, accumulator_dtype="float64")

