"""Split mode on PyTorch: `micro_batch_size=b` cuts each batch into micro-batches
inside the step and makes one update per batch, equal to plain Keras on torch trained
on the whole batches; `"auto"` retries a batch that ran out of memory
(`torch.OutOfMemoryError`, or the CPU allocator's RuntimeError) with smaller
micro-batches, and a failed try leaves nothing behind."""

from __future__ import annotations

import re

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
    own_loss,
)

import gradaccum
from gradaccum.attach import accumulation_of


def _adam(model, **compile_kwargs):
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"], **compile_kwargs)
    return model


def _plain(x, y, batch_size, epochs, sample_weight=None, model=None):
    reference = _adam(model or mlp())
    history = reference.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
                            epochs=epochs, shuffle=False, verbose=0)
    return reference, history


def _assert_same_training(model, history, reference, expected, names=("loss", "accuracy")):
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    for name in names:
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5,
                                   err_msg=name)


def _state(model):
    return accumulation_of(model).state


def _assert_empty_window(model):
    state = _state(model)
    assert int(state.micro_step.numpy()) == 0
    assert float(state.total_weight.numpy()) == 0.0
    assert all(not np.any(a.numpy()) for a in state.accumulators)


# Equal to plain Keras on the whole batch ------------------------------------------------


@pytest.mark.parametrize("size", [16, 7, 1, 40, 64])
def test_batches_of_40_split_equal_plain_fit_at_40_with_adam_for_3_epochs(size):
    # 100 samples: batches 40, 40 and a last short 20; 16 splits a batch of 40 as
    # 16 + 16 + 8 (not evenly), 7 as five 7s and a 5, 40 and 64 not at all.
    x, y = data(100)
    model = _adam(gradaccum.accumulate(mlp(), micro_batch_size=size))
    history = model.fit(x, y, batch_size=40, epochs=3, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 3)
    assert max_gap(model, mlp()) > 1e-2
    _assert_same_training(model, history, reference, expected)
    assert int(model.optimizer.iterations) == 9
    assert history.history["updates"] == [3.0, 6.0, 9.0]
    assert history.history["skipped"] == [0.0, 0.0, 0.0]
    # The last batch of each epoch, 20 samples: 16 + 4 (or as many micro-batches).
    last = {16: 2, 7: 3, 1: 20, 40: 1, 64: 1}[size]
    assert history.history["window_micro_batches"] == [float(last)] * 3
    assert history.history["window_weight"] == [20.0] * 3
    assert model.micro_batch_size == size
    _assert_empty_window(model)


def test_train_on_batch_logs_the_whole_batch():
    x, y = data(40)
    model = _adam(gradaccum.accumulate(mlp(), micro_batch_size=16))
    reference = _adam(mlp())
    for batch in (slice(0, 40), slice(0, 13)):
        logs = model.train_on_batch(x[batch], y[batch], return_dict=True)
        expected = reference.train_on_batch(x[batch], y[batch], return_dict=True)
        np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)
        np.testing.assert_allclose(logs["accuracy"], expected["accuracy"], rtol=1e-6)
    assert logs["updates"] == 2.0
    assert logs["window_micro_batches"] == 1.0
    assert logs["window_weight"] == 13.0
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)


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
    # Batches of 18 as 5 + 5 + 5 + 3. Keras's loss divides the sample-weighted sum
    # by the number of samples, so a micro-batch weighs its samples.
    x, y = data(36)
    codes = np.random.default_rng(4).integers(0, 9, size=(36, 4)).astype("int32")
    inputs = {"numbers": x, "codes": codes}
    sw = np.random.default_rng(5).uniform(0.1, 2.0, size=36).astype("float32")
    model = _adam(gradaccum.accumulate(_two_inputs(), micro_batch_size=5))
    history = model.fit(inputs, y, sample_weight=sw, batch_size=18, epochs=2,
                        shuffle=False, verbose=0)
    reference, expected = _plain(inputs, y, 18, 2, sample_weight=sw, model=_two_inputs())
    assert max_gap(model, _two_inputs()) > 1e-2
    _assert_same_training(model, history, reference, expected)
    assert history.history["window_weight"] == [18.0, 18.0]
    assert history.history["window_micro_batches"] == [4.0, 4.0]


def _sequence_model(seed=0):
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def _sequences(n=12, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([1, 2, 7, 7, 6, 3, 2, 1, 5, 7, 4, 2] * (n // 12))
    x = np.zeros((n, 7), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, 20, size=length)
    y = rng.integers(0, 5, size=(n, 7)).astype("int32")
    return x, y, lengths


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_masked_sequences_are_weighted_by_their_tokens(optimizer):
    # Per-token loss over masked positions: each micro-batch's normalizer is its
    # count of unmasked tokens, unequal between micro-batches (5 + 5 + 2 sequences of
    # 23, 18 and 6 tokens). Torch's Embedding gradient is dense, so Adam is exact too.
    x, y, lengths = _sequences()

    def made(model):
        model.compile(keras.optimizers.SGD(0.5) if optimizer == "sgd"
                      else keras.optimizers.Adam(0.02), SCE)
        return model

    model = made(gradaccum.accumulate(_sequence_model(), micro_batch_size=5))
    history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    reference = made(_sequence_model())
    expected = reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert max_gap(model, _sequence_model()) > 1e-3
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    # The window's weight is its unmasked tokens, not its sequences.
    assert history.history["window_weight"] == [float(lengths.sum())] * 2
    assert history.history["window_micro_batches"] == [3.0, 3.0]


def test_uniform_weighting_is_the_plain_mean_of_the_micro_batches():
    # weighting="uniform" weighs the micro-batches alike (Keras's own accumulation):
    # on 40 = 16 + 16 + 8 it is the mean of three micro-batch gradients, not plain fit.
    x, y = data(40)
    model = gradaccum.accumulate(mlp(), micro_batch_size=16, weighting="uniform")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    exact = gradaccum.accumulate(mlp(), micro_batch_size=16)
    exact.compile(keras.optimizers.SGD(0.5), SCE)
    exact.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    assert max_gap(model, exact) > 1e-4
    # The reference: the mean of the three micro-batch gradients, by hand.
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    sums = None
    for part in (slice(0, 16), slice(16, 32), slice(32, 40)):
        reference.zero_grad()
        loss = SCE(torch.as_tensor(y[part]), reference(torch.as_tensor(x[part])))
        loss.backward()
        grads = [v.value.grad.clone() for v in reference.trainable_weights]
        sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
    with torch.no_grad():
        reference.optimizer.apply([s / 3 for s in sums], reference.trainable_weights)
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
    assert max_gap(model, own_loss()) > 1e-2
    assert_weights_close(model, reference)


def _bn_model(layer_cls):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), layer_cls(momentum=0.8), keras.layers.Dense(3)])


def test_batch_normalization_moves_once_per_batch_from_the_whole_batch():
    # moving_statistics="window": Keras's own layer's moving mean and variance move
    # once per batch, from the whole batch's statistics (12 = 5 + 5 + 2; 26 = 12, 12, 2).
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(26, 5)) * 2 + 1).astype("float32")
    y = rng.integers(0, 3, size=26)
    model = gradaccum.accumulate(_bn_model(keras.layers.BatchNormalization),
                                 micro_batch_size=5)
    model.compile(optimizer="adam", loss=SCE)
    model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    reference = _bn_model(keras.layers.BatchNormalization)
    reference.compile(optimizer="adam", loss=SCE)
    reference.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    bn, ref_bn = model.layers[0], reference.layers[0]
    assert not np.allclose(bn.moving_mean.numpy(), 0.0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), ref_bn.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), ref_bn.moving_variance.numpy(),
                               rtol=1e-5)


def test_a_batch_whose_arrays_disagree_on_their_first_dimension():
    x, y = data(40)
    model = _adam(gradaccum.accumulate(mlp(), micro_batch_size=8))
    model.train_on_batch(x, y)
    with pytest.raises(ValueError, match=re.escape(
        "The tensors of a batch must agree on their first (batch) dimension to be split "
        "into micro-batches. Received: first dimensions [39, 40] (shapes (40, 6), (39,))"
    )):
        model.train_on_batch(x, y[:39])


# Non-finite micro-batches ------------------------------------------------------------------


def test_a_non_finite_micro_batch_is_dropped_with_its_weight():
    # Batch 1 (samples 0-19) as 8 + 8 + 4: sample 9 holds an inf, so micro-batch 2
    # (samples 8-15) is skipped; the update is plain fit's on samples 0-7 and 16-19,
    # and the logged loss and metric are those of the 12 samples used.
    x, y = data(40)
    bad = x.copy()
    bad[9, 0] = np.inf
    model = gradaccum.accumulate(mlp(), micro_batch_size=8)
    model.compile(keras.optimizers.SGD(0.5), SCE, metrics=["accuracy"])
    with pytest.warns(UserWarning, match="skipped"):
        history = model.fit(bad, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE, metrics=["accuracy"])
    keep = np.r_[0:8, 16:20]
    first = reference.train_on_batch(x[keep], y[keep], return_dict=True)
    second = reference.train_on_batch(x[20:], y[20:], return_dict=True)
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert history.history["skipped"] == [1.0]
    assert history.history["updates"] == [2.0]
    assert history.history["window_micro_batches"] == [3.0]
    # The logs: each batch's loss (over the samples used) weighed by its size, as
    # Keras weighs a batch's; the metric counts the 12 + 20 samples used.
    np.testing.assert_allclose(history.history["loss"],
                               [(first["loss"] + second["loss"]) / 2], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"],
                               [(first["accuracy"] * 12 + second["accuracy"] * 20) / 32],
                               rtol=1e-6)


def test_nonfinite_raise_names_the_micro_batch_and_leaves_no_window():
    x, y = data(40)
    bad = x.copy()
    bad[29, 0] = np.nan  # batch 2 (20 = 8 + 8 + 4), its micro-batch 2 (samples 28-35)
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
    _assert_empty_window(model)
    # The next fit starts from an empty window.
    model.fit(x[20:], y[20:], batch_size=20, epochs=1, shuffle=False, verbose=0)
    reference.train_on_batch(x[20:], y[20:])
    assert_weights_close(model, reference)


# micro_batch_size="auto" -------------------------------------------------------------------


def _cuda_error(n):
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {n} samples' activations (GPU 0; "
        "79.11 GiB total capacity)")


def _cpu_error(n):
    return RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
        f"memory: you tried to allocate {n * 2**30} bytes.")


class OutOfMemoryAbove(keras.layers.Layer):
    """Passes its input through; in training, on more than `limit` samples it fails as
    torch's allocator fails when memory runs out (`error(n)` makes the error)."""

    def __init__(self, limit, error=_cuda_error, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit
        self.error = error
        self.tried = []

    def call(self, x, training=False):
        # (Keras's symbolic build of the model runs without `training`.)
        if training:
            n = int(x.shape[0])
            self.tried.append(n)
            if n > self.limit:
                raise self.error(n)
        return x


def _limited(limit, error=_cuda_error):
    """`mlp()`'s layers behind an `OutOfMemoryAbove(limit)`."""
    inner = mlp()
    return keras.Sequential([keras.Input((6,)), OutOfMemoryAbove(limit, error),
                             *inner.layers])


def test_torch_out_of_memory_errors_are_recognized():
    from gradaccum.backends.torch.step import is_out_of_memory

    assert isinstance(_cuda_error(1), RuntimeError)
    assert is_out_of_memory(_cuda_error(1)) and is_out_of_memory(_cpu_error(1))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


@pytest.mark.parametrize("error", [_cuda_error, _cpu_error], ids=["cuda", "cpu"])
def test_auto_halves_until_a_size_runs_and_equals_plain_fit(error, capsys):
    # Batches of 40: 40 and 20 run out of memory, 10 runs; the search then probes 15
    # (out of memory) and 12 (runs), then 13 fails and 12 is where it settles. Each
    # failed try (its micro-batches' sums, metrics, counters) leaves no trace.
    x, y = data(200)
    model = _adam(gradaccum.accumulate(_limited(12, error), micro_batch_size="auto"))
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=2)
    reference, expected = _plain(x, y, 40, 2)
    _assert_same_training(model, history, reference, expected)
    search = accumulation_of(model).auto_size
    assert search.failures == [40, 20, 15, 13]
    assert model.layers[0].tried[:9] == [40, 20, 10, 10, 10, 10, 15, 12, 12]
    assert model.micro_batch_size == 12
    assert history.history["micro_batch_size"] == [12.0, 12.0]
    assert history.history["updates"] == [5.0, 10.0]
    assert history.history["window_micro_batches"] == [4.0, 4.0]  # 12 + 12 + 12 + 4
    assert history.history["window_weight"] == [40.0, 40.0]
    assert int(model.optimizer.iterations) == 10
    _assert_empty_window(model)
    assert (
        'gradaccum: micro_batch_size="auto" settled on 12 samples per micro-batch '
        "(40, 20, 15, 13 ran out of memory)."
    ) in capsys.readouterr().out


class RealOutOfMemoryAbove(keras.layers.Layer):
    """Passes its input through; in training, on more than `limit` samples it asks
    torch's allocator for 32 PiB per sample on the input's device: a real
    out-of-memory error (the CPU allocator's RuntimeError, CUDA's
    torch.OutOfMemoryError)."""

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def call(self, x, training=False):
        n = int(x.shape[0])
        if training and n > self.limit:
            huge = torch.empty(n * 2**55, dtype=torch.uint8, device=x.device)
            return x + 0.0 * huge[0]
        return x


def test_auto_retries_a_real_out_of_memory_error_of_the_allocator():
    x, y = data(80)
    inner = mlp()
    model = keras.Sequential([keras.Input((6,)), RealOutOfMemoryAbove(12), *inner.layers])
    model = _adam(gradaccum.accumulate(model, micro_batch_size="auto"))
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 2)
    _assert_same_training(model, history, reference, expected)
    assert accumulation_of(model).auto_size.failures == [40, 20, 15, 13]
    assert model.micro_batch_size == 12


class OutOfMemoryOnce(keras.layers.Layer):
    """Passes its input through, but its `nth` training call (counted from 1, over
    the whole run) runs out of memory: a failure in the middle of a batch's
    micro-batches, after the ones before it were added and counted."""

    def __init__(self, nth, **kwargs):
        super().__init__(**kwargs)
        self.nth = nth
        self.calls = 0

    def call(self, x, training=False):
        if training:
            self.calls += 1
            if self.calls == self.nth:
                raise _cuda_error(int(x.shape[0]))
        return x


def test_auto_failure_in_a_later_micro_batch_leaves_no_trace():
    # Cap 16, batches of 40 (16 + 16 + 8): the second micro-batch of the first batch
    # runs out of memory once. The first one's sum, metric updates and counters are
    # undone with the rest, so training and logs equal plain fit's. (The search then
    # runs 8, probes up from it and settles on 15, below the size that failed.)
    x, y = data(100)
    reference, expected = _plain(x, y, 40, 2)
    inner = mlp()
    faulty = keras.Sequential([keras.Input((6,)), OutOfMemoryOnce(2), *inner.layers])
    model = _adam(gradaccum.accumulate(faulty, micro_batch_size="auto",
                                       max_micro_batch_size=16))
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert accumulation_of(model).auto_size.failures == [16]
    _assert_same_training(model, history, reference, expected)
    assert history.history["updates"] == [3.0, 6.0]
    assert history.history["skipped"] == [0.0, 0.0]
    assert model.micro_batch_size == 15
    assert history.history["micro_batch_size"] == [14.0, 15.0]  # 8, 12, 14; 15
    assert history.history["window_weight"] == [20.0, 20.0]
    _assert_empty_window(model)


def test_a_failed_try_leaves_every_value_as_a_run_that_never_failed():
    # One batch of 40: micro-batches of 16 and 16 ran and the third (8) ran out of
    # memory; the retry at 8 must end bit for bit where a fixed micro_batch_size=8
    # ends: the state's variables (sums, counters), the metrics, the optimizer.
    x, y = data(40)

    def trained(layer, **options):
        inner = mlp()
        model = _adam(gradaccum.accumulate(
            keras.Sequential([keras.Input((6,)), layer, *inner.layers]), **options))
        logs = model.train_on_batch(x, y, return_dict=True)
        return model, logs

    failed, failed_logs = trained(OutOfMemoryOnce(3), micro_batch_size="auto",
                                  max_micro_batch_size=16)
    clean, clean_logs = trained(OutOfMemoryOnce(0), micro_batch_size=8)
    assert accumulation_of(failed).auto_size.failures == [16]
    assert failed_logs.pop("micro_batch_size") == 8.0
    assert failed_logs == clean_logs
    assert failed_logs["window_micro_batches"] == 5.0
    assert_weights_close(failed, clean, rtol=0, atol=0)
    assert_optimizer_close(failed.optimizer, clean.optimizer, rtol=0, atol=0)
    for a, b in zip(failed.metrics_variables, clean.metrics_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    ours, theirs = _state(failed).named(), _state(clean).named()
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name].numpy(), theirs[name].numpy(), err_msg=name)


def test_auto_with_a_cap_and_a_batch_that_fits():
    x, y = data(80)
    model = _adam(gradaccum.accumulate(_limited(1000), micro_batch_size="auto",
                                       max_micro_batch_size=16))
    history = model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 1)
    _assert_same_training(model, history, reference, expected)
    assert accumulation_of(model).auto_size.failures == []
    assert model.micro_batch_size == 16
    assert history.history["micro_batch_size"] == [16.0]


def test_auto_runs_a_batch_that_fits_whole():
    x, y = data(80)
    model = _adam(gradaccum.accumulate(_limited(1000), micro_batch_size="auto"))
    history = model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    reference, expected = _plain(x, y, 40, 1)
    _assert_same_training(model, history, reference, expected)
    assert model.micro_batch_size == 40
    assert history.history["micro_batch_size"] == [40.0]
    assert history.history["window_micro_batches"] == [1.0]


@pytest.mark.parametrize("error", [_cuda_error, _cpu_error], ids=["cuda", "cpu"])
def test_auto_out_of_memory_at_one_sample_is_raised_with_a_note(error):
    x, y = data(8)
    model = _adam(gradaccum.accumulate(_limited(0, error), micro_batch_size="auto"))
    expected = torch.OutOfMemoryError if error is _cuda_error else RuntimeError
    with pytest.raises(expected, match="out of memory|can't allocate memory") as info:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert (
        "gradaccum: micro_batch_size='auto' ran out of memory with micro-batches of 1 "
        "sample."
    ) in info.value.__notes__
    assert model.layers[0].tried == [8, 4, 2, 1]
    assert accumulation_of(model).auto_size.failures == [8, 4, 2]
    assert int(model.optimizer.iterations) == 0
    assert_weights_close(model, mlp(), rtol=0, atol=0)
    _assert_empty_window(model)


def test_auto_other_errors_are_not_retried():
    class Broken(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def call(self, x, training=False):
            if training:
                self.calls += 1
                raise RuntimeError("CUDA error: device-side assert triggered")
            return x

    broken = Broken()
    model = keras.Sequential([keras.Input((6,)), broken, keras.layers.Dense(3)])
    model = _adam(gradaccum.accumulate(model, micro_batch_size="auto"))
    x, y = data(8)
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert broken.calls == 1
    assert accumulation_of(model).auto_size.failures == []
    assert int(model.optimizer.iterations) == 0
    assert len(model.get_weights()) == 2


class FailingUpdate(keras.optimizers.SGD):
    """An optimizer whose update runs out of memory after its first variable."""

    def update_step(self, gradient, variable, learning_rate):
        if variable is not self._trainable_variables[0]:
            raise _cuda_error(0)
        super().update_step(gradient, variable, learning_rate)


def test_auto_does_not_retry_a_failure_in_the_update():
    # Memory that runs out while the optimizer applies the window is not the
    # micro-batches': a smaller size changes nothing, and the update (begun) must not
    # be applied twice.
    x, y = data(40)
    model = gradaccum.accumulate(_limited(1000), micro_batch_size="auto")
    model.compile(FailingUpdate(0.1), SCE)
    with pytest.raises(torch.OutOfMemoryError) as info:
        model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    assert "cannot retry this batch" in "\n".join(getattr(info.value, "__notes__", []))
    assert accumulation_of(model).auto_size.failures == []
    assert model.layers[0].tried == [40]
    _assert_empty_window(model)


@pytest.mark.parametrize(
    "options", [dict(weighting="uniform"), dict(reduction="sum")], ids=["uniform", "sum"]
)
def test_auto_refuses_options_whose_update_depends_on_the_split(options):
    with pytest.raises(ValueError) as info:
        gradaccum.accumulate(mlp(), micro_batch_size="auto", **options)
    weighting = options.get("weighting", "exact")
    reduction = options.get("reduction", "mean")
    assert str(info.value) == (
        '`weighting` must be "exact" or a callable, and `reduction` "mean", with '
        'micro_batch_size="auto": "auto" changes the split, which must not change the '
        f"update. Received: weighting={weighting!r}, reduction={reduction!r}"
    )


def test_disable_removes_the_size_and_wrap_round_trips_its_config():
    model = gradaccum.accumulate(mlp(), micro_batch_size=8)
    assert model.micro_batch_size == 8
    gradaccum.disable(model)
    assert "micro_batch_size" not in vars(model)
    trainer = gradaccum.wrap(mlp(), micro_batch_size="auto", max_micro_batch_size=32)
    config = trainer.get_config()
    assert (config["steps"], config["micro_batch_size"], config["max_micro_batch_size"]) == (
        None, "auto", 32
    )


def test_a_failed_try_leaves_the_loss_scale_as_it_found_it():
    # LossScaleOptimizer: micro-batch 1 (of 8 + 8) overflows, so the scale halves;
    # micro-batch 2 then runs out of memory. The retry at 4 must start from the scale
    # the batch found: it ends where a fixed micro_batch_size=4 ends (halved once).
    x, y = data(16)
    x[1, 0] = np.inf

    def trained(layer, **options):
        inner = mlp()
        model = gradaccum.accumulate(
            keras.Sequential([keras.Input((6,)), layer, *inner.layers]), **options)
        model.compile(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.5), initial_scale=1024.0), SCE)
        logs = model.train_on_batch(x, y, return_dict=True)
        return model, logs

    failed, failed_logs = trained(OutOfMemoryOnce(2), micro_batch_size="auto",
                                  max_micro_batch_size=8)
    clean, clean_logs = trained(OutOfMemoryOnce(0), micro_batch_size=4)
    assert accumulation_of(failed).auto_size.failures == [8]
    assert failed_logs.pop("micro_batch_size") == 4.0
    assert failed_logs == clean_logs
    assert failed_logs["skipped"] == 1.0
    assert float(clean.optimizer.dynamic_scale.numpy()) == 512.0
    assert_weights_close(failed, clean, rtol=0, atol=0)
    assert_optimizer_close(failed.optimizer, clean.optimizer, rtol=0, atol=0)


def test_auto_a_batch_that_raises_leaves_no_window():
    # nonfinite="raise" under "auto": micro-batch 2 of the first batch (8 + 8 + 4 of
    # 20) holds a nan. The error is not retried, and the window it interrupted is gone:
    # the next fit trains as plain fit from the weights it found.
    x, y = data(40)
    bad = x.copy()
    bad[9, 0] = np.nan
    model = gradaccum.accumulate(_limited(1000), micro_batch_size="auto",
                                 max_micro_batch_size=8, nonfinite="raise")
    model.compile(keras.optimizers.SGD(0.5), SCE)
    with pytest.raises(FloatingPointError, match=re.escape(
        "in micro-batch 2 (counted from 1; the micro-batch 2 of its window)"
    )):
        model.fit(bad, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    assert accumulation_of(model).auto_size.failures == []
    assert int(model.optimizer.iterations) == 0
    _assert_empty_window(model)
    model.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.5), SCE)
    reference.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, reference)
