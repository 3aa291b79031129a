"""Mixed precision on JAX (issue 30): `mixed_float16` with a LossScaleOptimizer and
`mixed_bfloat16`, each against plain Keras on JAX trained on the windows with the same
policy and optimizer."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from largebatch import SCE, assert_weights_close, data, reference_fit, windows_of

import gradaccum


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def _mlp(seed=0):
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3, dtype="float32"),
    ])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def _scaled_sgd(**kwargs):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), **kwargs)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_mixed_float16_with_loss_scaling_equals_the_windows(policy):
    # 7 micro-batches of 4, steps=3: windows of 3, 3 and the flushed 1. The scale
    # (2**15) is a power of two: unscaling is exact, so only float16 forward passes
    # of different batch shapes separate the two runs.
    x, y = data(28)
    model = gradaccum.accumulate(_mlp(), steps=3)
    model.compile(_scaled_sgd(), SCE)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _mlp()
    reference.compile(_scaled_sgd(), SCE)
    reference_fit(reference, windows_of([4] * 7, [3, 3, 1]), x, y)
    assert_weights_close(model, reference, rtol=1e-3, atol=1e-3)
    assert history.history["updates"] == [3.0]
    assert history.history["skipped"] == [0.0]
    # Accumulators stay float32 under a float16 compute dtype.
    state = gradaccum.attach.accumulation_of(model).state
    assert {str(v.dtype) for v in state.accumulators} == {"float32"}
    # Finite micro-batches count as the scale's finite steps: 7 of them.
    assert int(model.optimizer.step_counter.numpy()) == 7


def test_an_overflowing_micro_batch_is_skipped_and_the_scale_halves():
    # Micro-batch 2 (of 6, steps=3) holds an inf: its gradient overflows, it is
    # skipped (not raised, not warned) and the scale halves at once; the windows are
    # the other micro-batches, each normalized by its own weights.
    x, y = data(24)
    x[5, 0] = np.inf
    model = gradaccum.accumulate(_mlp(), steps=3, nonfinite="raise")
    model.compile(_scaled_sgd(initial_scale=1024.0), SCE)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [2.0]
    assert float(model.optimizer.dynamic_scale.numpy()) == 512.0
    # After the skip the counter restarts: micro-batches 3-6 are 4 finite steps.
    assert int(model.optimizer.step_counter.numpy()) == 4
    reference = _mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference_fit(reference, [np.r_[0:4, 8:12], np.arange(12, 24)], x, y)
    assert_weights_close(model, reference)


def test_the_scale_doubles_after_its_growth_steps_of_micro_batches():
    # dynamic_growth_steps=2: the scale doubles after every 2 finite micro-batches,
    # as Keras's LossScaleOptimizer after 2 finite steps; the weights do not move
    # with it (a power of two unscales exactly). The last micro-batch holds 2 samples:
    # the weight comes with the unscaling, exact for unequal micro-batches.
    x, y = data(22)
    model = gradaccum.accumulate(_mlp(), steps=3)
    model.compile(_scaled_sgd(initial_scale=8.0, dynamic_growth_steps=2), SCE)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == 8.0 * 2**3
    reference = _mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference_fit(reference, windows_of([4] * 5 + [2], [3, 3]), x, y)
    assert_weights_close(model, reference)


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_mixed_bfloat16_equals_the_windows(policy):
    x, y = data(24)
    model = gradaccum.accumulate(_mlp(), steps=3)
    model.compile(keras.optimizers.Adam(0.01), SCE)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference = _mlp()
    reference.compile(keras.optimizers.Adam(0.01), SCE)
    reference_fit(reference, windows_of([4] * 6, [3, 3]), x, y, epochs=2)
    assert_weights_close(model, reference, rtol=2e-2, atol=2e-2)
    state = gradaccum.attach.accumulation_of(model).state
    assert {str(v.dtype) for v in state.accumulators} == {"float32"}
