"""Mixed precision on PyTorch: `mixed_float16` with a LossScaleOptimizer and
`mixed_bfloat16`, each against plain Keras on torch trained on the windows with the
same policy and optimizer; float32 sums, an overflowing micro-batch skipped with the
scale backing off. And `jit_compile=True` (Keras torch.compiles the step) against the
eager run."""

from __future__ import annotations

import keras
import numpy as np
import pytest
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

import gradaccum
from gradaccum.attach import accumulation_of


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True)
def _float32_after():
    # Whatever a test does, the next one starts under float32.
    yield
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


def _accumulator_dtypes(model):
    return {str(v.dtype) for v in accumulation_of(model).state.accumulators}


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_mixed_float16_with_loss_scaling_equals_the_windows(policy):
    # 7 micro-batches of 4, steps=3: windows of 3, 3 and the flushed 1. The scale
    # (2**15) is a power of two: unscaling is exact, so only float16 forward passes
    # of different batch shapes separate the two runs.
    x, y = data(28)
    model = gradaccum.accumulate(_mlp(), steps=3)
    model.compile(_scaled_sgd(), SCE)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[0].kernel.dtype == "float32"
    reference = _mlp()
    reference.compile(_scaled_sgd(), SCE)
    reference_fit(reference, windows_of([4] * 7, [3, 3, 1]), x, y)
    assert max_gap(model, _mlp()) > 1e-2
    assert_weights_close(model, reference, rtol=1e-3, atol=1e-3)
    assert int(model.optimizer.iterations) == 3
    assert history.history["updates"] == [3.0]
    assert history.history["skipped"] == [0.0]
    # Accumulators stay float32 under a float16 compute dtype.
    assert _accumulator_dtypes(model) == {"float32"}
    # Finite micro-batches count as the scale's finite steps: 7 of them.
    assert int(model.optimizer.step_counter.numpy()) == 7
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_mixed_float16_equals_the_float32_run_without_overflow(policy):
    # Against the same accumulation in float32 (no loss scaling): float16's forward
    # pass rounds, nothing else differs.
    x, y = data(24)
    model = gradaccum.accumulate(_mlp(), steps=3)
    model.compile(_scaled_sgd(), SCE)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    keras.mixed_precision.set_global_policy("float32")
    full = gradaccum.accumulate(_mlp(), steps=3)
    full.compile(keras.optimizers.SGD(0.5), SCE)
    full.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_gap(full, _mlp()) > 1e-2
    assert_weights_close(model, full, rtol=1e-2, atol=2e-3)
    assert int(model.optimizer.iterations) == int(full.optimizer.iterations) == 4


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"], indirect=True)
def test_an_overflowing_micro_batch_is_skipped_and_the_scale_halves(policy):
    # Micro-batch 2 (of 6, steps=3) holds an inf: its gradient overflows, it is
    # skipped (not raised, not warned, whatever `nonfinite` says) and the scale
    # halves at once; the windows are the other micro-batches, each normalized by its
    # own weights.
    x, y = data(24)
    x[5, 0] = np.inf
    model = gradaccum.accumulate(_mlp(), steps=3, nonfinite="raise")
    model.compile(_scaled_sgd(initial_scale=1024.0), SCE, metrics=["accuracy"])
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [2.0]
    assert history.history["window_micro_batches"] == [3.0]
    assert float(model.optimizer.dynamic_scale.numpy()) == 512.0
    # After the skip the counter restarts: micro-batches 3-6 are 4 finite steps.
    assert int(model.optimizer.step_counter.numpy()) == 4
    assert np.isfinite(history.history["loss"][0])
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert _accumulator_dtypes(model) == {"float32"}
    keras.mixed_precision.set_global_policy("float32")
    reference = _mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference_fit(reference, [np.r_[0:4, 8:12], np.arange(12, 24)], x, y)
    if policy == "float32":
        assert_weights_close(model, reference)
    else:
        assert_weights_close(model, reference, rtol=1e-2, atol=2e-3)


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
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert model.layers[0].compute_dtype == "bfloat16"
    reference = _mlp()
    reference.compile(keras.optimizers.Adam(0.01), SCE)
    reference_fit(reference, windows_of([4] * 6, [3, 3]), x, y, epochs=2)
    assert max_gap(model, _mlp()) > 1e-2
    assert_weights_close(model, reference, rtol=2e-2, atol=2e-2)
    assert int(model.optimizer.iterations) == 4
    assert history.history["updates"] == [2.0, 4.0]
    assert _accumulator_dtypes(model) == {"float32"}
    # Against float32 accumulation: bfloat16's forward pass rounds, nothing else.
    keras.mixed_precision.set_global_policy("float32")
    full = gradaccum.accumulate(_mlp(), steps=3)
    full.compile(keras.optimizers.Adam(0.01), SCE)
    full.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, full, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("growth", [2000, 3])
def test_split_mode_with_loss_scaling_equals_plain_fit_under_the_policy(policy, growth):
    # The scale counts finite batches, as plain fit does: with growth every 3 steps
    # it doubles after 3 batches (not 3 micro-batches), and no micro-batch overflows
    # where plain fit's batches do not.
    def scaled():
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.5), dynamic_growth_steps=growth
        )

    x, y = data(40)
    model = gradaccum.accumulate(_mlp(), micro_batch_size=4)
    model.compile(scaled(), SCE)
    history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    reference = _mlp()
    reference.compile(scaled(), SCE)
    reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, reference, rtol=1e-3, atol=1e-3)
    assert int(model.optimizer.iterations) == 4
    assert history.history["skipped"] == [0.0, 0.0]
    for name in ("step_counter", "dynamic_scale"):
        assert float(getattr(model.optimizer, name).numpy()) == float(
            getattr(reference.optimizer, name).numpy()
        ), name
    assert _accumulator_dtypes(model) == {"float32"}


# jit_compile=True: Keras torch.compiles the step ----------------------------------------


def _fit_adam(model, x, y, jit_compile, batch_size=4, epochs=2):
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"],
                  jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                        verbose=0)
    return history


@pytest.mark.parametrize("options", [dict(steps=3), dict(micro_batch_size=5)],
                         ids=["steps", "split"])
def test_jit_compile_equals_the_eager_run(options):
    # 30 samples in batches of 10: with steps=3 one window of the three batches per
    # epoch; in split mode each batch as 5 + 5. (One shape throughout: each new one
    # would compile again.) The state machine runs outside the compiled graphs.
    from torch._dynamo.utils import counters

    x, y = data(30)
    compiled = gradaccum.accumulate(mlp(), **options)
    graphs = counters["stats"]["unique_graphs"]
    history = _fit_adam(compiled, x, y, jit_compile=True, batch_size=10)
    assert compiled.jit_compile is True
    # The model's passes compiled (the state machine kept out of the graphs).
    assert counters["stats"]["unique_graphs"] > graphs
    eager = gradaccum.accumulate(mlp(), **options)
    expected = _fit_adam(eager, x, y, jit_compile=False, batch_size=10)
    assert max_gap(compiled, mlp()) > 1e-2
    assert_weights_close(compiled, eager, rtol=1e-6, atol=1e-7)
    assert_optimizer_close(compiled.optimizer, eager.optimizer, rtol=1e-6, atol=1e-7)
    assert history.history.keys() == expected.history.keys()
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-6, err_msg=name)
    updates = 2.0 if "steps" in options else 6.0
    assert history.history["updates"] == [updates / 2, updates]
    # And the eager run is the large batch's: plain Keras on the windows.
    reference = mlp()
    reference.compile(keras.optimizers.Adam(0.01), SCE)
    windows = (windows_of([10] * 3, [3]) if "steps" in options
               else windows_of([10] * 3, [1, 1, 1]))
    reference_fit(reference, windows, x, y, epochs=2)
    assert_weights_close(eager, reference)
