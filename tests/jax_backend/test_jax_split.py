"""Split mode on JAX (issue 30): `micro_batch_size=b` cuts each batch into micro-batches
inside the compiled step and makes one update per batch, equal to plain Keras on JAX
trained on the whole batches; `"auto"` retries a batch that ran out of memory with
smaller micro-batches."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
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
    own_loss,
)
from test_jax_mixed_precision import _mlp as _mixed_mlp

import gradaccum
from gradaccum.attach import accumulation_of
from gradaccum.backends.jax import retry


def _adam(model, **compile_kwargs):
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"], **compile_kwargs)
    return model


def _plain(x, y, batch_size, epochs, sample_weight=None, model=None):
    reference = _adam(model or mlp())
    history = reference.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
                            epochs=epochs, shuffle=False, verbose=0)
    return reference, history


def _assert_same_training(model, history, reference, expected):
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)


@pytest.mark.parametrize("size", [16, 7, 1, 40, 64])
def test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs(size):
    # 100 samples: batches 40, 40 and 20 (the last batch is a shorter window); 16
    # splits a batch of 40 as 16 + 16 + 8, 7 as five 7s and a 5, 64 not at all.
    x, y = data(100)
    model = _adam(gradaccum.accumulate(mlp(), micro_batch_size=size))
    history = model.fit(x, y, batch_size=40, epochs=3, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 3)
    assert max_gap(model, mlp()) > 1e-2
    _assert_same_training(model, history, reference, expected)
    assert int(model.optimizer.iterations) == 9
    assert history.history["updates"] == [3.0, 6.0, 9.0]
    # The last batch of each epoch, 20 samples: 16 + 4 (or as many micro-batches).
    last = {16: 2, 7: 3, 1: 20, 40: 1, 64: 1}[size]
    assert history.history["window_micro_batches"] == [float(last)] * 3
    assert history.history["window_weight"] == [20.0] * 3
    assert model.micro_batch_size == size


def _two_inputs(seed=0):
    numbers = keras.Input((6,), name="numbers")
    codes = keras.Input((4,), dtype="int32", name="codes")
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(9, 5)(codes))
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()([numbers, embedded])
    )
    model = keras.Model({"numbers": numbers, "codes": codes}, keras.layers.Dense(3)(hidden))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def test_nested_inputs_and_sample_weights_are_split_alike():
    x, y = data(36)
    codes = np.random.default_rng(4).integers(0, 9, size=(36, 4)).astype("int32")
    inputs = {"numbers": x, "codes": codes}
    sw = np.random.default_rng(5).uniform(0.1, 2.0, size=36).astype("float32")
    model = _adam(gradaccum.accumulate(_two_inputs(), micro_batch_size=5))
    history = model.fit(inputs, y, sample_weight=sw, batch_size=18, epochs=2,
                        shuffle=False, verbose=0)
    reference, expected = _plain(inputs, y, 18, 2, sample_weight=sw, model=_two_inputs())
    _assert_same_training(model, history, reference, expected)


def _sequence_model(seed=0):
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def test_masked_sequences_are_weighted_by_their_tokens():
    # Per-token loss over masked positions: each micro-batch's normalizer is its
    # count of unmasked tokens, unequal between micro-batches.
    rng = np.random.default_rng(0)
    lengths = np.array([1, 2, 7, 7, 6, 3, 2, 1, 5, 7, 4, 2])
    x = np.zeros((12, 7), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rng.integers(1, 20, size=n)
    y = rng.integers(0, 5, size=(12, 7)).astype("int32")
    model = gradaccum.accumulate(_sequence_model(), micro_batch_size=5)
    model.compile(keras.optimizers.SGD(0.5), SCE)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    reference = _sequence_model()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert max_gap(model, _sequence_model()) > 1e-3
    assert_weights_close(model, reference)


def test_a_models_own_compute_loss_runs_per_micro_batch():
    # Equal micro-batches (8 + 8 + 8): the extra term's mean is exact with them.
    x, y = data(48)
    model = gradaccum.accumulate(own_loss(), micro_batch_size=8)
    model.compile(keras.optimizers.SGD(0.5), SCE)
    model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    reference = own_loss()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, reference)


def test_steps_per_execution_runs_two_split_batches_per_call():
    x, y = data(80)
    model = _adam(gradaccum.accumulate(mlp(), micro_batch_size=12), steps_per_execution=2)
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 2)
    _assert_same_training(model, history, reference, expected)
    assert history.history["updates"] == [2.0, 4.0]


def test_a_non_finite_micro_batch_is_dropped_with_its_weight():
    # Batch 1 (samples 0-19) as 8 + 8 + 4: sample 9 holds an inf, so micro-batch 2
    # (samples 8-15) is skipped; the update is plain fit's on samples 0-7 and 16-19.
    x, y = data(40)
    bad = x.copy()
    bad[9, 0] = np.inf
    model = gradaccum.accumulate(mlp(), micro_batch_size=8)
    model.compile(keras.optimizers.SGD(0.5), SCE)
    with pytest.warns(UserWarning, match="skipped"):
        history = model.fit(bad, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    keep = np.r_[0:8, 16:20]
    reference.train_on_batch(x[keep], y[keep])
    reference.train_on_batch(x[20:], y[20:])
    assert_weights_close(model, reference)
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [2.0]


def test_nonfinite_raise_leaves_no_update_and_no_window():
    x, y = data(40)
    bad = x.copy()
    bad[29, 0] = np.nan  # batch 2 (20 + 8 + 4 samples), its micro-batch 2 (28-35)
    model = gradaccum.accumulate(mlp(), micro_batch_size=8, nonfinite="raise")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    with pytest.raises(FloatingPointError, match=re.escape(
        "in micro-batch 5 (counted from 1; the micro-batch 2 of its window)"
    )):
        model.fit(bad, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.train_on_batch(x[:20], y[:20])
    # The first batch's update stands; the failed batch left nothing behind.
    assert int(model.optimizer.iterations) == 1
    assert_weights_close(model, reference)
    state = accumulation_of(model).state
    assert int(state.micro_step.numpy()) == 0
    assert all(not np.any(a.numpy()) for a in state.accumulators)
    # The next fit starts from an empty window.
    model.fit(x[20:], y[20:], batch_size=20, epochs=1, shuffle=False, verbose=0)
    reference.train_on_batch(x[20:], y[20:])
    assert_weights_close(model, reference)


@pytest.mark.parametrize("growth", [2000, 3])
def test_mixed_float16_with_loss_scaling_equals_plain_fit_under_the_policy(growth):
    # The scale counts finite batches, as plain fit does: with growth every 3 steps
    # it doubles after 3 batches (not 3 micro-batches), and no micro-batch overflows
    # where plain fit's batches do not.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def scaled():
            return keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.5), dynamic_growth_steps=growth
            )

        x, y = data(40)
        model = gradaccum.accumulate(_mixed_mlp(), micro_batch_size=4)
        model.compile(scaled(), SCE)
        history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
        reference = _mixed_mlp()
        reference.compile(scaled(), SCE)
        reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_weights_close(model, reference, rtol=1e-3, atol=1e-3)
    assert int(model.optimizer.iterations) == 4
    assert history.history["skipped"] == [0.0, 0.0]
    for name in ("step_counter", "dynamic_scale"):
        assert float(getattr(model.optimizer, name).numpy()) == float(
            getattr(reference.optimizer, name).numpy()
        ), name


def test_a_batch_whose_arrays_disagree_on_their_first_dimension():
    # After a first batch (Keras's symbolic build on the first one checks its
    # shapes itself).
    x, y = data(40)
    model = _adam(gradaccum.accumulate(mlp(), micro_batch_size=8))
    model.train_on_batch(x, y)
    with pytest.raises(ValueError, match=re.escape(
        "The tensors of a batch must agree on their first (batch) dimension to be split "
        "into micro-batches. Received: first dimensions [39, 40] (shapes (40, 6), (39,))"
    )):
        model.train_on_batch(x, y[:39])


# micro_batch_size="auto" -------------------------------------------------------------


class OutOfMemoryAbove(keras.layers.Layer):
    """Passes its input through, and fails as XLA fails when memory runs out when
    compiled for more than `limit` samples."""

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def call(self, x, training=False):
        # (In training: Keras's symbolic build of the model allocates nothing.)
        if training and isinstance(x.shape[0], int) and x.shape[0] > self.limit:
            raise jax.errors.JaxRuntimeError(
                f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {x.shape[0]} "
                "samples' activations."
            )
        return x


def _limited(limit):
    """`mlp()`'s layers behind an `OutOfMemoryAbove(limit)`."""
    inner = mlp()
    return keras.Sequential([keras.Input((6,)), OutOfMemoryAbove(limit), *inner.layers])


def test_auto_halves_until_a_size_runs_and_equals_plain_fit(capsys):
    # Batches of 40: 40 and 20 run out of memory, 10 runs; the search then probes 15
    # (out of memory) and 12 (runs), then 13 fails and 12 is where it settles.
    x, y = data(200)
    model = _adam(gradaccum.accumulate(_limited(12), micro_batch_size="auto"))
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=2)
    reference, expected = _plain(x, y, 40, 2)
    _assert_same_training(model, history, reference, expected)
    search = accumulation_of(model).auto_size
    assert search.failures == [40, 20, 15, 13]
    assert model.micro_batch_size == 12
    assert history.history["micro_batch_size"] == [12.0, 12.0]
    assert (
        'gradaccum: micro_batch_size="auto" settled on 12 samples per micro-batch '
        "(40, 20, 15, 13 ran out of memory)."
    ) in capsys.readouterr().out


class RealOutOfMemoryAbove(keras.layers.Layer):
    """Passes its input through; compiled for more than `limit` samples it asks XLA
    for a buffer of about 4 TB when it runs, a real out-of-memory error."""

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def call(self, x, training=False):
        n = x.shape[0]
        if training and isinstance(n, int) and n > self.limit:
            huge = jnp.sort(jnp.broadcast_to(x[:, :1], (n, 2**40 // n)), axis=0)
            return x + 0.0 * huge[0, 0]
        return x


@pytest.mark.parametrize("jit_compile", [True, False], ids=["jit", "no_jit"])
def test_auto_retries_a_real_out_of_memory_error_of_the_run(jit_compile):
    # The failed call ran (and failed) on the state: it was not donated to it, so
    # the same state trains on with the next size.
    x, y = data(80)
    inner = mlp()
    model = keras.Sequential([keras.Input((6,)), RealOutOfMemoryAbove(12), *inner.layers])
    model = _adam(gradaccum.accumulate(model, micro_batch_size="auto"),
                  jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 2)
    _assert_same_training(model, history, reference, expected)
    assert accumulation_of(model).auto_size.failures[:2] == [40, 20]
    assert model.micro_batch_size == 12


def test_auto_with_a_cap_and_a_batch_that_fits():
    x, y = data(80)
    model = _adam(gradaccum.accumulate(_limited(1000), micro_batch_size="auto",
                                       max_micro_batch_size=16))
    history = model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 1)
    _assert_same_training(model, history, reference, expected)
    assert accumulation_of(model).auto_size.failures == []
    assert model.micro_batch_size == 16


def test_auto_out_of_memory_at_one_sample_is_raised_with_a_note():
    x, y = data(8)
    model = _adam(gradaccum.accumulate(_limited(0), micro_batch_size="auto"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as info:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert (
        "gradaccum: micro_batch_size='auto' ran out of memory with micro-batches of 1 "
        "sample."
    ) in info.value.__notes__
    assert int(model.optimizer.iterations) == 0


def test_auto_other_errors_are_not_retried():
    class Broken(keras.layers.Layer):
        def call(self, x, training=False):
            if training:
                raise jax.errors.JaxRuntimeError("INTERNAL: something else")
            return x

    model = keras.Sequential([keras.Input((6,)), Broken(), keras.layers.Dense(3)])
    model = _adam(gradaccum.accumulate(model, micro_batch_size="auto"))
    x, y = data(8)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(model).auto_size.failures == []
    # The model's variables are its own again after the failed first batch.
    assert int(model.optimizer.iterations) == 0
    assert len(model.get_weights()) == 2


def test_a_state_consumed_by_the_failed_call_is_not_retried_on():
    kept, deleted = jnp.ones(3), jnp.ones(3)
    deleted.delete()
    assert not retry.consumed(([kept], [kept]))
    assert retry.consumed(([kept], [deleted]))
