"""tf.distribute: replicas accumulate locally and reduce once per update, exactly.

MirroredStrategy runs over the two logical CPU devices made by the root conftest;
MultiWorkerMirroredStrategy over two worker processes on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum.attach import accumulation_of
from test_keras_model import SCE, data, mlp, plan_windows, reference_fit


def trainer_of(door, model, **options):
    """What to compile and fit: wrap's trainer, or the model itself (accumulate)."""
    if door == "wrap":
        return gradaccum.wrap(model, **options)
    return gradaccum.accumulate(model, **options)


def state_of(door, trainer):
    return trainer._fit_state if door == "wrap" else accumulation_of(trainer).state

DEVICES = ["/cpu:0", "/cpu:1"]
WORKER = pathlib.Path(__file__).with_name("multiworker_job.py")


_DEFAULT_STRATEGY = []


def mirrored(cross_device_ops=None):
    """A MirroredStrategy over the two logical CPUs.

    With its default cross-device ops (collectives) one instance serves the whole
    process. Strategies made in one process must number their collectives apart: the
    root conftest moves the base before each test, and this moves it again before
    making the shared one (a test may make its own strategy first).
    """
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs two logical CPU devices (set up by the root conftest)")
    if cross_device_ops is not None:
        return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=cross_device_ops)
    if not _DEFAULT_STRATEGY:
        from tensorflow.python.distribute import mirrored_strategy

        mirrored_strategy.MirroredStrategy._collective_key_base += 100000
        _DEFAULT_STRATEGY.append(tf.distribute.MirroredStrategy(DEVICES))
    return _DEFAULT_STRATEGY[0]


def replica_loss(model, x, y):
    """The replica's own mean loss (0 on an empty share), as on one device."""
    per_sample = keras.losses.sparse_categorical_crossentropy(
        y, model(x, training=True), from_logits=True
    )
    return tf.math.divide_no_nan(
        tf.reduce_sum(per_sample), tf.cast(tf.size(per_sample), per_sample.dtype)
    )


def custom_loop(strategy, model, optimizer, acc, batches):
    """strategy.run(step) over the global micro-batches; returns the update flags."""

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = replica_loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        return acc.step(optimizer, grads, weight=tf.shape(x)[0])

    @tf.function
    def step(x, y):
        flags = strategy.run(replica_step, args=(x, y))
        return strategy.experimental_local_results(flags)[0]

    flags = [bool(step(x, y)) for x, y in strategy.experimental_distribute_dataset(batches)]
    with strategy.scope():
        acc.apply(optimizer)  # the partial window at the end of the data
    return flags


def windows_of(sizes, steps):
    """Global index windows for micro-batches of `sizes`, closing a last partial one."""
    bounds = np.cumsum([0, *sizes])
    micro = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return [np.concatenate(micro[i:i + steps]) for i in range(0, len(micro), steps)]


# MirroredStrategy: exactness -------------------------------------------------------


def test_custom_loop_on_two_replicas_equals_one_device_on_the_global_windows():
    strategy = mirrored()
    x, y = data(29, seed=4)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 8, 8, 8, 5
    # Per replica 4/4 three times, then 3/2: unequal shares, exactly weighted.
    with strategy.scope():
        model = mlp()
        optimizer = keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)
    flags = custom_loop(strategy, model, optimizer, acc, batches)
    assert flags == [False, False, True, False]
    assert int(optimizer.iterations.numpy()) == 2 and int(acc.micro_step.numpy()) == 0

    ref = mlp()
    ref.compile(keras.optimizers.Adam(0.05), SCE)
    reference_fit(ref, windows_of([8, 8, 8, 5], 3), x, y)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_fit_on_two_replicas_equals_one_device_adam_epochs_partial_window(door):
    strategy = mirrored()
    x, y = data(50)
    windows, _ = plan_windows(50, 8, 3, epochs=3)  # 7 micro-batches: 3 + 3 + 1 (of 2)
    ref = mlp()
    ref.compile(keras.optimizers.Adam(0.02), SCE)
    reference_fit(ref, windows, x, y)

    with strategy.scope():
        model = mlp()
        trainer = trainer_of(door, model, steps=3)
        trainer.compile(keras.optimizers.Adam(0.02), SCE)
    # One micro-batch per compiled call: Keras's multi-step function fails under
    # MirroredStrategy (keras issue 19246), so "window" resolves to 1 here.
    assert trainer.steps_per_execution == 1
    history = trainer.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0, 6.0, 9.0]
    assert int(state_of(door, trainer).accumulator.micro_step.numpy()) == 0
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(trainer.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_partial_drop_on_two_replicas_equals_one_device(door):
    # 7 micro-batches of 8 per epoch with steps=3: two windows, then one micro-batch
    # dropped at each epoch's end (no optimizer applies it: no update to trace).
    strategy = mirrored()
    x, y = data(50)
    windows, _ = plan_windows(50, 8, 3, epochs=2, partial="drop")
    ref = mlp()
    ref.compile(keras.optimizers.Adam(0.02), SCE)
    reference_fit(ref, windows, x, y)
    with strategy.scope():
        model = mlp()
        trainer = trainer_of(door, model, steps=3, partial="drop")
        trainer.compile(keras.optimizers.Adam(0.02), SCE)
    history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [2.0, 4.0]
    assert int(state_of(door, trainer).accumulator.micro_step.numpy()) == 0
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_replica_share_with_a_non_finite_gradient_is_dropped_with_its_weight(door):
    """nonfinite="skip" screens each replica's share: the poisoned share (rows 0-3 of
    the first micro-batch, on replica 0) is dropped, the other replica's share of
    that micro-batch is kept, and the window equals one device on the good rows."""
    strategy = mirrored()
    x, y = data(16)
    bad = x.copy()
    bad[1, 0] = np.nan
    ref = mlp()
    ref.compile(keras.optimizers.Adam(0.02), SCE)
    ref.train_on_batch(x[4:], y[4:])
    with strategy.scope():
        model = mlp()
        trainer = trainer_of(door, model, steps=2)
        trainer.compile(keras.optimizers.Adam(0.02), SCE)
    history = trainer.fit(bad, y, batch_size=8, shuffle=False, verbose=0)
    assert history.history["updates"] == [1.0]
    assert history.history["skipped"] == [1.0]
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fit_with_steps_1_is_exact_for_unequal_replica_shares():
    # Keras alone averages the replicas' means: 5 samples as 3/2 weigh 1/2 each.
    strategy = mirrored()
    x, y = data(21, seed=5)  # batches 8, 8, 5
    ref = mlp()
    ref.compile(keras.optimizers.SGD(0.5), SCE)
    reference_fit(ref, windows_of([8, 8, 5], 1), x, y)
    with strategy.scope():
        model = mlp()
        trainer = gradaccum.wrap(model, steps=1)
        trainer.compile(keras.optimizers.SGD(0.5), SCE)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.02}])
def test_clipping_acts_on_the_reduced_gradient(clip):
    strategy = mirrored()
    x, y = data(48, seed=6)
    windows, _ = plan_windows(48, 8, 3, epochs=1)
    ref = mlp()
    ref.compile(keras.optimizers.SGD(0.5, **clip), SCE)
    reference_fit(ref, windows, x, y)
    with strategy.scope():
        model = mlp()
        trainer = gradaccum.wrap(model, steps=3)
        trainer.compile(keras.optimizers.SGD(0.5, **clip), SCE)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# Communication: one reduction per update ------------------------------------------


@pytest.mark.parametrize("steps", [1, 4, 16])
def test_one_cross_replica_reduction_per_update_in_fit(steps, door):
    ops = gradaccum.CountingCrossDeviceOps()
    strategy = mirrored(ops)
    n, batch = 16 * 8, 8  # 16 micro-batches: 16 / steps updates
    x, y = data(n)
    with strategy.scope():
        model = mlp()
        trainer = trainer_of(door, model, steps=steps)
        trainer.compile(keras.optimizers.Adam(0.01), SCE)
    trainer.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    updates = int(trainer.optimizer.iterations.numpy())
    assert updates == 2 * 16 // steps
    assert int(ops.reductions) == updates
    # Each reduction carries every accumulator, the weight total, the received
    # counts (one float32 per variable) and the window's count of skipped shares.
    variables = model.trainable_variables
    assert int(ops.tensors) == updates * (len(variables) + 3)
    payload = sum(int(np.prod(v.shape)) for v in variables) * 4 + 4 + 4 * len(variables)
    payload += 4
    assert int(ops.bytes) == updates * payload


def test_one_cross_replica_reduction_per_update_in_a_custom_loop():
    ops = gradaccum.CountingCrossDeviceOps()
    strategy = mirrored(ops)
    x, y = data(40)
    with strategy.scope():
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=5)
    flags = custom_loop(strategy, model, optimizer, acc,
                        tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
    assert sum(flags) == 2 and int(optimizer.iterations.numpy()) == 2
    assert int(ops.reductions) == 2


def test_accumulator_state_is_replica_local_and_saved_as_the_global_sum(tmp_path):
    strategy = mirrored()
    x, y = data(16)
    with strategy.scope():
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=4)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = replica_loss(model, xb, yb)
        acc.accumulate(tape.gradient(loss, model.trainable_variables), tf.shape(xb)[0])

    for xb, yb in strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    ):
        strategy.run(replica_step, args=(xb, yb))
    # Two micro-batches of 8 (4 per replica): read across replicas, the weights sum.
    assert float(acc.total_weight.numpy()) == 16.0 and int(acc.micro_step.numpy()) == 2
    expected = [g.numpy() * 16 for g in _mean_gradients(model, x, y)]
    for a, e in zip(acc.accumulators, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)
    path = tf.train.Checkpoint(acc=acc).save(str(tmp_path / "ckpt"))
    with strategy.scope():
        other = gradaccum.GradientAccumulator(model.trainable_variables, steps=4)
    tf.train.Checkpoint(acc=other).restore(path).assert_existing_objects_matched()
    assert float(other.total_weight.numpy()) == 16.0 and int(other.micro_step.numpy()) == 2
    for a, b in zip(other.accumulators, acc.accumulators):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def _mean_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        )
    return tape.gradient(loss, model.trainable_variables)


# Bad input ---------------------------------------------------------------------------


def test_wrap_refuses_a_model_built_outside_the_strategy_scope():
    strategy = mirrored()
    model = mlp()
    with strategy.scope(), pytest.raises(ValueError) as info:
        gradaccum.wrap(model, steps=2)
    assert str(info.value) == (
        "The model's variables must be created inside the scope of the distribution "
        "strategy in use (MirroredStrategy with 2 replicas). Received: variables created "
        "outside `strategy.scope()`, which the replicas would share. Build the model and "
        "the optimizer inside `with strategy.scope():`, and create the accumulator (or "
        "call `gradaccum.wrap` and `compile`) there too."
    )


@pytest.mark.parametrize("sums", ["sharded", "reduced"])
def test_fit_refuses_sums_other_than_local_under_several_replicas(sums):
    strategy = mirrored()
    x, y = data(16)
    with strategy.scope():
        model = gradaccum.accumulate(mlp(), steps=2, sums=sums)
        model.compile(keras.optimizers.Adam(0.02), SCE)
    with pytest.raises(ValueError) as info:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert str(info.value) == (
        '`sums` must be "local" under tf.distribute: each replica keeps whole sums of '
        f"its own micro-batches, added once per update. Received: sums={sums!r} under "
        'MirroredStrategy with 2 replicas. Pass sums="local"; sums="sharded" runs on '
        "JAX under keras.distribution and on PyTorch under DistributedDataParallel "
        "(GradientAccumulator)."
    )


def test_custom_loop_refuses_an_accumulator_of_variables_built_outside_the_scope():
    strategy = mirrored()
    model = mlp()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    x, y = data(8)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = replica_loss(model, xb, yb)
        return acc.step(optimizer, tape.gradient(loss, model.trainable_variables))

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )
    with pytest.raises(ValueError, match=r"must be created inside the scope of the "
                       r"distribution strategy in use \(MirroredStrategy with 2 replicas\)"):
        for xb, yb in dataset:
            strategy.run(tf.function(replica_step), args=(xb, yb))


def test_accumulate_outside_strategy_run_is_refused():
    strategy = mirrored()
    with strategy.scope():
        model = mlp()
        acc = gradaccum.GradientAccumulator(model.trainable_variables)
        with pytest.raises(ValueError) as info:
            acc.accumulate([tf.zeros_like(v) for v in model.trainable_variables])
    assert str(info.value) == (
        "`accumulate` must be called in a replica context under MirroredStrategy: call "
        "it inside `strategy.run(...)`, where each replica adds its own gradients. "
        "Received: a call in cross-replica context."
    )


# MultiWorkerMirroredStrategy: two processes -------------------------------------------


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_multi_worker_mirrored_two_processes_equal_a_single_process(tmp_path):
    """A custom loop and fit() (accumulate and wrap) on 2 workers of 127.0.0.1."""
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    try:
        for index in range(2):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
                       TF_CONFIG=json.dumps({"cluster": cluster,
                                             "task": {"type": "worker", "index": index}}))
            log = open(tmp_path / f"worker{index}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(tmp_path / f"worker{index}.npz")],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
        for proc in procs:
            proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the workers did not finish in 240 s: " + _logs(tmp_path))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], _logs(tmp_path)

    import multiworker_job

    expected = multiworker_job.single_process_reference()
    poisoned = multiworker_job.poisoned_reference()
    for index in range(2):
        got = np.load(tmp_path / f"worker{index}.npz")
        for i, want in enumerate(expected["loop"]):
            np.testing.assert_allclose(got[f"loop_{i}"], want, rtol=1e-5, atol=1e-6)
        assert int(got["loop_updates"]) == expected["loop_updates"] == 4
        # fit() under the strategy, through both doors: the same global windows
        # (the last batch's 3 / 2 shares weighted exactly), one reduction per update.
        for door in ("accumulate", "wrap"):
            for i, want in enumerate(expected["loop"]):
                np.testing.assert_allclose(got[f"{door}_{i}"], want, rtol=1e-5, atol=1e-6)
            assert int(got[f"{door}_updates"]) == 4
            assert list(got[f"{door}_logged_updates"]) == [2.0, 4.0]
            assert int(got[f"{door}_reductions"]) == 4
            np.testing.assert_allclose(got[f"{door}_evaluate"], expected["evaluate"],
                                       rtol=1e-5)
            # The last epoch's validation (evaluate inside fit) saw the same weights.
            np.testing.assert_allclose(got[f"{door}_validation"], expected["evaluate"],
                                       rtol=1e-5)
        # Loss scaling: worker 0's poisoned share dropped with its weight in both
        # epochs, the scale halved at each of those windows' updates on both
        # workers (32768 -> 8192), one reduction per update.
        for i, want in enumerate(poisoned):
            np.testing.assert_allclose(got[f"scaled_{i}"], want, rtol=1e-5, atol=1e-6)
        assert list(got["scaled_skipped"]) == [1.0, 2.0]
        assert float(got["scaled_scale"]) == 8192.0
        assert int(got["scaled_reductions"]) == 4
    # Privacy (issue 43, item 4): both workers add the same noise, once per global
    # window; seeded, the result is one process's with the same seed.
    private = multiworker_job.private_reference()
    first, second = (np.load(tmp_path / f"worker{index}.npz") for index in range(2))
    for i, want in enumerate(private):
        np.testing.assert_array_equal(first[f"private_seeded_{i}"],
                                      second[f"private_seeded_{i}"])
        np.testing.assert_array_equal(first[f"private_drawn_{i}"],
                                      second[f"private_drawn_{i}"])
        np.testing.assert_allclose(first[f"private_seeded_{i}"], want, rtol=1e-5,
                                   atol=1e-6)
    assert max(float(np.abs(first[f"private_drawn_{i}"] - w).max())
               for i, w in enumerate(private)) > 1e-4


def _logs(folder):
    return "\n".join(p.read_text()[-3000:] for p in sorted(folder.glob("worker*.log")))


class OwnStepMLP(keras.Model):
    """The test MLP with its own train_step (Keras's compute_loss, its optimizer),
    which scales its loss as Keras's own step does (a no-op without loss scaling)."""

    def __init__(self, source):
        super().__init__()
        self.net = source

    def call(self, x):
        return self.net(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_the_noise_scale_counts_each_replicas_share_as_a_piece():
    # A linear model at fixed weights, its noise scale known (about 21 samples: see
    # tests/contract/test_noise_scale.py): each replica's share of each micro-batch
    # is a piece, at steps=4 (8 pieces of 8 per window) and at steps=1 (2 of 32):
    # the estimate is one device's on the same pieces (micro-batches of 8, of 32).
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "contract"))
    from test_noise_scale import linear, linear_data

    x, y, weights, truth = linear_data(1.0, 64 * 128)
    strategy = mirrored()
    for steps, batch in ((4, 16), (1, 64)):
        with strategy.scope():
            model = linear(weights, steps=steps, noise_scale=True)
        replicas = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        one = linear(weights, steps=steps * 2, noise_scale=True).fit(
            x, y, batch_size=batch // 2, epochs=1, shuffle=False, verbose=0)
        estimate = replicas.history["noise_scale"][0]
        assert abs(estimate / truth - 1) < 0.15, (steps, estimate, truth)
        np.testing.assert_allclose(estimate, one.history["noise_scale"][0], rtol=1e-4)
