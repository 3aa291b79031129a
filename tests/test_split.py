"""Split mode (issue 15): `micro_batch_size=b` splits every batch inside the training
step and makes one update per batch, equal to plain Keras `fit` at that batch."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum.attach import accumulation_of
from gradaccum.core.auto_size import AutoSize
from helpers import assert_same_state, make_trainer, trained
from test_accumulate import OwnStep, Penalized, TwoOptimizers, seeded
from test_keras_model import SCE, assert_weights_close, data, max_gap, mlp

OOM_JOB = pathlib.Path(__file__).with_name("oom_job.py")


def compile_adam(model, metrics=("accuracy",), **kwargs):
    metrics = list(metrics) or None  # [] would make compiled metrics nothing updates
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=metrics, **kwargs)
    return model


def plain_fit(x, y, batch_size, epochs, model=None, **fit_kwargs):
    """Plain Keras fit at `batch_size`: the reference."""
    model = compile_adam(mlp() if model is None else model)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return model, history


# Equivalence with plain fit at the batch -------------------------------------------


def test_batch_40_as_16_16_8_equals_plain_fit_at_40_adam_3_epochs(door):
    """100 samples: batches 40, 40 and an uneven 20 (16 + 4); sample weights too."""
    x, y = data(100)
    sample_weight = np.random.default_rng(3).uniform(0.2, 2.0, 100).astype("float32")
    reference, expected = plain_fit(x, y, 40, 3, sample_weight=sample_weight)

    model = mlp()
    trainer = compile_adam(make_trainer(door, model, micro_batch_size=16))
    history = trainer.fit(
        x, y, sample_weight=sample_weight, batch_size=40, epochs=3, shuffle=False, verbose=0
    )
    assert max_gap(model, mlp()) > 1e-2
    assert_same_state(model, trainer.optimizer, reference, reference.optimizer)
    assert int(trainer.optimizer.iterations) == 9
    assert history.history["updates"] == [3.0, 6.0, 9.0]
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    assert trainer.micro_batch_size == 16


def masked_sequences(n=50, length=7, seed=4):
    """Float sequences padded with all-zero steps (masked by `Masking`), per-step
    targets and per-step sample weights."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, length + 1, size=n)
    x = rng.normal(size=(n, length, 3)).astype("float32")
    x[np.arange(length)[None, :] >= lengths[:, None]] = 0.0
    targets = rng.integers(0, 5, size=(n, length)).astype("int32")
    # Per-step weights: Keras does not broadcast per-sequence ones with a mask.
    weights = rng.uniform(0.5, 2, (n, length)).astype("float32")
    return x, targets, weights


def sequence_model():
    # Not an Embedding: Keras's Adam squares an IndexedSlices gradient per duplicate
    # index (sum of squares, not the square of the sum), so the large-batch step
    # itself depends on how the gradient is represented.
    keras.utils.set_random_seed(5)
    inputs = keras.Input((None, 3))
    hidden = keras.layers.Masking(0.0)(inputs)
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    return keras.Model(inputs, keras.layers.Dense(5)(hidden))


def test_masks_and_sample_weights_split_alike():
    """Per-step loss over padded sequences (masked) with per-step sample weights:
    micro-batches of unequal unmasked counts, combined exactly."""
    x, y, sample_weight = masked_sequences()
    reference = compile_adam(sequence_model())
    expected = reference.fit(x, y, sample_weight=sample_weight, batch_size=20, epochs=2,
                             shuffle=False, verbose=0)
    model = compile_adam(gradaccum.accumulate(sequence_model(), micro_batch_size=8))
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=20, epochs=2,
                        shuffle=False, verbose=0)
    assert max_gap(model, sequence_model()) > 1e-2
    assert_same_state(model, model.optimizer, reference, reference.optimizer)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


def two_inputs_model():
    keras.utils.set_random_seed(6)
    a, b = keras.Input((6,), name="a"), keras.Input((3,), name="b")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(hidden))


def test_nested_inputs_from_a_tf_data_pipeline():
    x, y = data(60)
    extra = np.random.default_rng(7).normal(size=(60, 3)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(({"a": x, "b": extra}, y)).batch(24)
    reference = compile_adam(two_inputs_model())
    reference.fit(dataset, epochs=2, verbose=0)
    model = compile_adam(gradaccum.accumulate(two_inputs_model(), micro_batch_size=10))
    model.fit(dataset, epochs=2, verbose=0)
    assert_same_state(model, model.optimizer, reference, reference.optimizer)
    assert int(model.optimizer.iterations) == 6  # batches 24, 24, 12 per epoch


def test_a_micro_batch_as_large_as_the_batch_is_plain_fit():
    x, y = data(40)
    reference, _ = plain_fit(x, y, 10, 2)
    model = compile_adam(gradaccum.accumulate(mlp(), micro_batch_size=64))
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert_same_state(model, model.optimizer, reference, reference.optimizer)


@pytest.mark.parametrize("cls", [Penalized, OwnStep], ids=["compute_loss", "train_step"])
def test_a_models_own_loss_and_step_run_per_micro_batch(cls):
    x, y = data(100)
    # No compiled metric: OwnStep's own step does not update them.
    reference = compile_adam(seeded(cls()), metrics=())
    reference.fit(x, y, batch_size=40, epochs=3, shuffle=False, verbose=0)
    model = gradaccum.accumulate(seeded(cls()), micro_batch_size=16)
    compile_adam(model, metrics=())
    history = model.fit(x, y, batch_size=40, epochs=3, shuffle=False, verbose=0)
    assert max_gap(model, seeded(cls())) > 1e-2
    assert_weights_close(model, reference, rtol=1e-5)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 9
    assert history.history["updates"] == [3.0, 6.0, 9.0]


def test_two_optimizers_of_an_own_step_each_update_once_per_batch():
    x, y = data(100)

    def made():
        model = TwoOptimizers()
        model(np.zeros((1, 6), "float32"))
        rng = np.random.default_rng(0)
        model.set_weights(
            [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()]
        )
        model.compile(keras.optimizers.Adam(0.02), keras.optimizers.SGD(0.1))
        return model

    reference = made()
    reference.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    model = made()
    gradaccum.accumulate(model, micro_batch_size=16)
    model.compile(keras.optimizers.Adam(0.02), keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, reference, rtol=1e-5)
    assert int(model.opt_a.iterations) == int(model.opt_b.iterations) == 6


# Updates, callbacks, schedules --------------------------------------------------------


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_ends, self.epoch_lrs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_ends.append((batch, int(self.model.optimizer.iterations)))


def test_callbacks_and_schedules_count_updates(door):
    """Batch callbacks see one call per update, a schedule counts updates, and
    LearningRateScheduler sets the rate the next epoch's updates use."""
    x, y = data(100)

    def schedule(epoch, lr):
        return 0.02 / (epoch + 1)

    def run(make):
        model = mlp()
        trainer = make(model)
        decay = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        trainer.compile(keras.optimizers.SGD(decay, momentum=0.5), SCE)
        recorder = Recorder()
        trainer.fit(x, y, batch_size=40, epochs=3, shuffle=False, verbose=0,
                    callbacks=[recorder])
        lr_model = mlp()
        lr_trainer = make(lr_model)
        lr_trainer.compile(keras.optimizers.Adam(0.01), SCE)
        lr_trainer.fit(x, y, batch_size=40, epochs=3, shuffle=False, verbose=0,
                       callbacks=[keras.callbacks.LearningRateScheduler(schedule)])
        return model, trainer, recorder, lr_model

    reference, ref_trainer, ref_recorder, ref_lr = run(lambda m: m)
    model, trainer, recorder, lr_model = run(
        lambda m: make_trainer(door, m, micro_batch_size=16)
    )
    assert recorder.batch_ends == ref_recorder.batch_ends == [
        (0, 1), (1, 2), (2, 3), (0, 4), (1, 5), (2, 6), (0, 7), (1, 8), (2, 9)
    ]
    assert_same_state(model, trainer.optimizer, reference, ref_trainer.optimizer)
    assert_weights_close(lr_model, ref_lr, rtol=1e-5)


# Options that change how a micro-batch runs --------------------------------------------


def test_jit_compile_compiles_each_micro_batch_any_batch_size():
    """XLA compiles the micro-batch; the loop runs around it, so batches that are not
    multiples of the micro-batch (40 = 16 + 16 + 8, 20 = 16 + 4) work."""
    x, y = data(100)
    reference, _ = plain_fit(x, y, 40, 2)
    model = compile_adam(gradaccum.accumulate(mlp(), micro_batch_size=16), jit_compile=True)
    model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert model.jit_compile is True
    assert_same_state(model, model.optimizer, reference, reference.optimizer)


def bn_model(layer_cls):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), layer_cls(momentum=0.8), keras.layers.Dense(3)])


def test_batch_normalization_window_is_the_batch(door):
    """gradaccum.BatchNormalization: moving statistics move once per batch, from the
    statistics of the whole batch, as Keras's layer fed the batch."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(26, 5)) * 2 + 1).astype("float32")
    y = rng.integers(0, 3, size=26)
    model = bn_model(gradaccum.BatchNormalization)
    trainer = make_trainer(door, model, micro_batch_size=5)
    trainer.compile(optimizer="adam", loss=SCE)
    trainer.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)

    reference = bn_model(keras.layers.BatchNormalization)
    reference.compile(optimizer="adam", loss=SCE)
    reference.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    bn, ref_bn = trained(door, trainer).layers[0], reference.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), ref_bn.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), ref_bn.moving_variance.numpy(), rtol=1e-5
    )
    # gamma and beta are not compared: each micro-batch is normalized with its own
    # statistics (the memory of a micro-batch), the large batch with the batch's.


def test_a_non_finite_micro_batch_is_dropped_with_its_weight():
    """A nan in the first micro-batch of the first batch: that micro-batch is
    dropped, and the update is plain training on the rest of the batch."""
    x, y = data(40)
    x[3, 0] = np.nan
    model = compile_adam(gradaccum.accumulate(mlp(), micro_batch_size=16))
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        history = model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0]
    reference = compile_adam(mlp())
    reference.train_on_batch(x[16:], y[16:])
    assert_same_state(model, model.optimizer, reference, reference.optimizer)


def test_mixed_float16_loss_scaling_equals_plain_fit_under_the_policy():
    """Loss scaling per micro-batch, unscaled into float32 accumulators. rtol 1e-3:
    float16 compute rounds the forward pass differently on 16 and 40 samples."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x, y = data(100)
        reference, _ = plain_fit(x, y, 40, 2)
        model = compile_adam(gradaccum.accumulate(mlp(), micro_batch_size=16))
        model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
        assert type(model.optimizer).__name__ == "LossScaleOptimizer"
        assert_weights_close(model, reference, rtol=1e-3, atol=1e-3)
        assert int(model.optimizer.iterations) == 6
    finally:
        keras.config.set_dtype_policy("float32")


def test_two_replicas_each_split_their_share_with_one_reduction_per_batch():
    from test_distribute import mirrored

    ops = gradaccum.CountingCrossDeviceOps()
    strategy = mirrored(ops)
    x, y = data(100)
    reference, _ = plain_fit(x, y, 40, 2)
    with strategy.scope():
        model = mlp()
        trainer = compile_adam(gradaccum.accumulate(model, micro_batch_size=8))
    trainer.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, reference, rtol=1e-5)
    assert int(trainer.optimizer.iterations.numpy()) == 6
    assert int(ops.reductions) == 6


# The model's attribute, disable, saving ---------------------------------------------


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
    again = gradaccum.AccumulatingModel.from_config(config)
    assert again.micro_batch_size is None and again.max_micro_batch_size == 32


# Bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True])
def test_invalid_micro_batch_size(value, door):
    with pytest.raises(ValueError) as info:
        make_trainer(door, mlp(), micro_batch_size=value)
    assert str(info.value) == (
        '`micro_batch_size` must be an integer >= 1 or "auto". '
        f"Received: micro_batch_size={value!r}"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(steps=4, micro_batch_size=16),
            "`steps` and `micro_batch_size` cannot be used together: `steps` counts the "
            "batches of one update, `micro_batch_size` splits each batch into "
            "micro-batches and updates once per batch. Received: steps=4, "
            "micro_batch_size=16",
        ),
        (
            dict(),
            "`steps`, `weight_per_update` or `micro_batch_size` must be given. "
            "Received: steps=None, weight_per_update=None, micro_batch_size=None",
        ),
        (
            dict(micro_batch_size=8, max_micro_batch_size=4),
            '`max_micro_batch_size` must be None unless micro_batch_size="auto". '
            "Received: max_micro_batch_size=4, micro_batch_size=8",
        ),
        (
            dict(micro_batch_size="auto", max_micro_batch_size=0),
            "`max_micro_batch_size` must be an integer >= 1. "
            "Received: max_micro_batch_size=0",
        ),
        (
            dict(micro_batch_size=8, partial="carry"),
            "`partial` must be 'flush' with `micro_batch_size`: each batch is one "
            "window, so no window is ever left partial at the end of the data. "
            "Received: partial='carry'",
        ),
    ],
    ids=["both", "neither", "cap-without-auto", "cap0", "partial"],
)
def test_invalid_window_options(options, message, door):
    with pytest.raises(ValueError) as info:
        make_trainer(door, mlp(), **options)
    assert str(info.value) == message


def test_a_batch_whose_tensors_disagree_on_their_first_dimension():
    x, y = data(40)
    model = compile_adam(gradaccum.accumulate(mlp(), micro_batch_size=8))
    static = tf.data.Dataset.from_tensors((x, y[:39]))
    with pytest.raises(ValueError) as info:
        model.fit(static, epochs=1, verbose=0)
    assert (
        "The tensors of a batch must agree on their first (batch) dimension to be split "
        "into micro-batches. Received: first dimensions [39, 40] (shapes (40, 6), (39,))"
    ) in str(info.value)

    def batches():
        yield x, y[:39]

    dynamic = tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec((None, 6), tf.float32), tf.TensorSpec((None,), tf.int64)
        ),
    )
    model = compile_adam(gradaccum.accumulate(mlp(), micro_batch_size=8))
    with pytest.raises(tf.errors.InvalidArgumentError, match="must agree on their first"):
        model.fit(dynamic, epochs=1, verbose=0)


# micro_batch_size="auto" -------------------------------------------------------------


def test_auto_search_halves_then_settles_on_the_largest_size_that_runs():
    search = AutoSize()
    tried = []
    for _ in range(4):  # batches of 40; sizes above 12 run out of memory
        while True:
            size = search.size_for(40)
            tried.append(size)
            if size > 12:
                search.failed(size)
                continue
            search.ran(size)
            break
    assert tried == [40, 20, 10, 15, 12, 13, 12, 12]
    assert search.settled and search.chosen == 12
    assert search.failures == [40, 20, 15, 13]


def test_auto_search_with_a_cap_and_a_batch_that_fits():
    search = AutoSize(cap=32)
    assert search.size_for(100) == 32
    search.ran(32)
    assert search.settled and search.chosen == 32
    assert search.size_for(10) == 10  # a smaller batch runs whole
    whole = AutoSize()
    whole.ran(40)
    assert whole.settled and whole.chosen == 40


def test_auto_search_goes_down_again_when_a_size_that_ran_fails():
    search = AutoSize()
    search.ran(16)
    search.failed(16)  # memory taken elsewhere since
    assert not search.settled
    assert search.size_for(40) == 8


def run_job(*args):
    command = [sys.executable, str(OOM_JOB), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_auto_in_a_process_that_runs_out_of_memory_equals_an_uninterrupted_run(tmp_path):
    """A model that runs out of memory above 12 samples, batches of 40: fit settles
    on 12 and ends with the weights, optimizer state and metrics of plain fit at 40
    (nothing applied twice, no metric counted twice)."""
    run_job("--limit", 12, "--out", tmp_path / "auto.npz")
    run_job("--limit", 12, "--out", tmp_path / "reference.npz", "--reference")
    auto, reference = np.load(tmp_path / "auto.npz"), np.load(tmp_path / "reference.npz")
    assert int(auto["chosen"]) == 12
    assert list(auto["failures"]) == [40, 20, 15, 13]
    keys = [k for k in reference.files if k.startswith(("weight_", "optimizer_"))]
    assert keys and all(k in auto.files for k in keys)
    for key in keys:
        np.testing.assert_allclose(auto[key], reference[key], rtol=1e-5, atol=1e-7, err_msg=key)
    history = json.loads(str(auto["history"]))
    expected = json.loads(str(reference["history"]))
    assert history["updates"] == [3.0, 6.0, 9.0]
    assert history["micro_batch_size"] == [12.0, 12.0, 12.0]
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)


def test_auto_with_an_own_train_step_rolls_back_the_failed_attempt():
    """The failed attempt created the step's accumulators and added to them: the
    retry starts from nothing, and the result is plain fit's."""
    from oom_job import OutOfMemoryAbove

    class Limited(OwnStep):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.limit = OutOfMemoryAbove(16)

        def call(self, x):
            return self.out(self.hidden(self.limit(x)))

    x, y = data(100)
    reference = compile_adam(seeded(OwnStep()), metrics=())
    reference.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    model = gradaccum.accumulate(seeded(Limited()), micro_batch_size="auto")
    compile_adam(model, metrics=())
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert model.micro_batch_size == 16
    assert_weights_close(model, reference, rtol=1e-5)
    assert int(model.optimizer.iterations) == 6
    assert history.history["micro_batch_size"] == [16.0, 16.0]


class FailingUpdate(keras.optimizers.SGD):
    """An optimizer whose update runs out of memory."""

    def update_step(self, gradient, variable, learning_rate):
        def fail(_):
            raise MemoryError("injected out-of-memory in the update")

        zero = tf.py_function(fail, [tf.constant(0)], tf.float32)
        variable.assign_sub(tf.cast(learning_rate, variable.dtype) * gradient + zero)


def test_auto_does_not_retry_a_failure_in_the_update():
    x, y = data(40)
    model = gradaccum.accumulate(mlp(), micro_batch_size="auto")
    model.compile(FailingUpdate(0.1), SCE)
    with pytest.raises(tf.errors.ResourceExhaustedError) as info:
        model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    assert "cannot retry this batch" in "\n".join(getattr(info.value, "__notes__", []))
    assert accumulation_of(model).auto_size.failures == []


def test_auto_on_two_replicas_rolls_back_every_replica():
    """Each replica's share (20 of 40) runs out of memory above 8: both retry, and
    training equals plain fit at 40 with one reduction per update."""
    from oom_job import OutOfMemoryAbove
    from test_distribute import mirrored

    def made(limit=None):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((6,))] + ([OutOfMemoryAbove(limit)] if limit else [])
        return keras.Sequential(layers + [keras.layers.Dense(8, activation="tanh"),
                                          keras.layers.Dense(3)])

    x, y = data(100)
    reference, expected = plain_fit(x, y, 40, 2, model=made())
    ops = gradaccum.CountingCrossDeviceOps()
    with mirrored(ops).scope():
        model = compile_adam(gradaccum.accumulate(made(8), micro_batch_size="auto"))
    history = model.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert model.micro_batch_size == 8
    assert_weights_close(model, reference, rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 6 == int(ops.reductions)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], expected.history["accuracy"])


def test_auto_failure_in_a_later_micro_batch_counts_no_metric_twice():
    """The second micro-batch of the first batch (16 + 16 + 8, cap 16) runs out of
    memory once: the first one's metric updates (made in the step's first trace)
    are undone with the rest, so the logs equal plain fit's."""
    from oom_job import OutOfMemoryOnce

    x, y = data(100)
    reference, expected = plain_fit(x, y, 40, 2)
    keras.utils.set_random_seed(0)
    model = mlp()
    faulty = keras.Sequential([keras.Input((6,)), OutOfMemoryOnce(2), *model.layers])
    trainer = compile_adam(
        gradaccum.accumulate(faulty, micro_batch_size="auto", max_micro_batch_size=16)
    )
    history = trainer.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    assert accumulation_of(trainer).auto_size.failures == [16]
    assert_same_state(model, trainer.optimizer, reference, reference.optimizer)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)


def test_a_step_that_raises_leaves_no_window_behind(door):
    """nonfinite="raise" stops fit in the second micro-batch of a batch; what that
    batch had accumulated is gone, so the next fit starts from an empty window."""
    x, y = data(40)
    bad = x.copy()
    bad[20, 0] = np.nan
    model = mlp()
    trainer = compile_adam(make_trainer(door, model, micro_batch_size=16, nonfinite="raise"))
    with pytest.raises(tf.errors.InvalidArgumentError):
        trainer.fit(bad, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    state = accumulation_of(trainer).state if door == "accumulate" else trainer._fit_state
    acc = state.accumulator
    assert int(acc.micro_step.numpy()) == 0 and float(acc.total_weight.numpy()) == 0.0
    assert all(not np.any(a.numpy()) for a in acc.accumulators)
    trainer.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    reference, _ = plain_fit(x, y, 40, 1)
    assert_same_state(model, trainer.optimizer, reference, reference.optimizer)


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
