"""keras.distribution on JAX (issue 30): `DataParallel` and `ModelParallel` on 2 and 4
virtual CPU devices, each exact against one device, with every accumulator laid out as
its variable (sharded like it under a LayoutMap, never whole on one device).

JAX fixes its devices when it starts, so each device count runs in a child process
(`distribution_job.py`, with `--xla_force_host_platform_device_count=N`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

JOB = pathlib.Path(__file__).with_name("distribution_job.py")
CASES = [
    (model, options, kind)
    for model in ("mlp", "tokens")
    for options in ("steps", "micro_batch_size")
    for kind in ("data_parallel", "model_parallel")
]


def run_job(devices: int) -> dict:
    env = dict(
        os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    done = subprocess.run(
        [sys.executable, str(JOB)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def jobs():
    return {}


def _results(jobs, devices):
    if devices not in jobs:
        jobs[devices] = run_job(devices)
    return jobs[devices]


def _check(results, devices):
    assert results["devices"] == devices
    # Keras's BatchNormalization follows the global window (its statistics are the
    # sharded batch's): as one device trained on the windows. Its statistics span
    # the devices' samples, so its sums are not kept per device: said once.
    assert results["batch_norm"] < 1e-6, results["batch_norm"]
    assert results["batch_norm_warnings"] == [
        f"gradaccum all-reduces each micro-batch's gradient under DataParallel "
        f"({devices} devices on mesh axis 'batch'): BatchNormalization layer(s) 'bn' "
        "normalize over all the devices' samples, so its sums cannot be kept per "
        "device. An update then costs one gradient all-reduce per micro-batch, as "
        "Keras's own step does."
    ]
    assert len(results["cases"]) == len(CASES)
    for case in results["cases"]:
        name = f"{case['model']} {case['options']} {case['kind']}"
        # Exact against one device, after training that moved the weights.
        assert case["moved"] > 1e-2, name
        assert case["gap"] < 1e-6, (name, case["gap"])
        assert case["loss_gap"] < 1e-5, (name, case["loss_gap"])
        steps = "steps" in case["options"]
        # 48 samples: 6 batches of 8 in windows of 3 (steps), or 4 batches of 12 each
        # one window (split mode, micro-batches of 8 and a shorter last one).
        assert case["updates"] == ([2.0, 4.0] if steps else [4.0, 8.0]), name
        for path, sharding in case["shardings"].items():
            assert sharding["devices"] == devices, (name, path)
            if not steps:
                # Split mode's sums live in the step: the state keeps a scalar.
                assert sharding["accumulator_shard"] == [], (name, path)
                continue
            rows = devices // 2 if case["kind"] == "model_parallel" else devices
            if rows == 1:
                # A batch axis of one device: the accumulator sits where its
                # variable sits (the same spec, the same shard on each device).
                assert sharding["accumulator"] == sharding["variable"], (name, path)
                assert sharding["accumulator_shard"] == sharding["variable_shard"]
                continue
            # Each accumulator keeps one row per device of the batch axis, and each
            # row sits where its variable sits: the rows sharded over "batch", then
            # the variable's own spec, so a device holds one row.
            variable = sharding["variable"][len("P("):-1].rstrip(",")
            assert sharding["accumulator"] == f"P('batch', {variable})", (name, path)
            assert sharding["accumulator_shard"] == [1, *sharding["variable_shard"]], (
                name, path)
            assert sharding["accumulator_shape"] == [rows, *sharding["shape"]], (name, path)
        _check_collectives(case, devices)
        if case["kind"] == "model_parallel" and steps:
            kernels = [s for p, s in case["shardings"].items()
                       if p.endswith(("kernel", "embeddings"))]
            assert kernels and all("'model'" in s["accumulator"] for s in kernels), name
            for sharding in kernels:
                # Half of the last dimension on each device of the "model" axis.
                assert sharding["accumulator_shard"][-1] * 2 == sharding["shape"][-1]


def _check_collectives(case, devices):
    """One all-reduce of the gradient per update: in the branch that applies it,
    where each device's rows are added; a micro-batch's step (and split mode's loop)
    reduces scalars only (a normalizer, a weight)."""
    name = f"{case['model']} {case['options']} {case['kind']}"
    assert case["warnings"] == [], name
    parallel = case["kind"] == "model_parallel"
    rows = devices // 2 if parallel else devices
    found = case["collectives"]
    update = sum(size for kind, size, place in found
                 if kind == "all-reduce" and place == "update")
    if rows == 1:
        return
    # Under ModelParallel each device holds half of every variable (the "model"
    # axis of 2), so it reduces half of the gradient.
    assert update == case["gradient_bytes"] // (2 if parallel else 1), (name, found)
    if not parallel:
        # (ModelParallel's own traffic, its activations on the "model" axis, runs
        # in every call, as in Keras's plain step.)
        every = [(kind, size) for kind, size, place in found if place != "update"]
        assert all(kind == "all-reduce" and size <= 16 for kind, size in every), (
            name, found)


def test_data_and_model_parallel_on_two_devices_equal_one_device(jobs):
    results = _results(jobs, 2)
    _check(results, 2)
    # "auto" under DataParallel: the whole batch of 8 runs (capped at 8), exact.
    assert results["auto"]["gap"] < 1e-6
    assert results["auto"]["size"] == 8


def test_data_and_model_parallel_on_four_devices_equal_one_device(jobs):
    results = _results(jobs, 4)
    _check(results, 4)
    # A layout that does not fit a variable (a dimension of 4 over 3 devices): the
    # accumulator cannot take it, said before anything trains.
    assert results["misfit"] == (
        "The layout of a trainable variable must fit it for its accumulator to take that "
        "layout: one mesh axis name (or None) per dimension, each sharded dimension "
        "divisible by its axes' size. Received: layout (None, 'model') on mesh "
        "{'batch': 1, 'model': 3} for variable 'built_on_one_device/dense_b/kernel' of shape "
        "(8, 4)"
    )
    # A micro-batch size the devices cannot share equally.
    assert results["indivisible"] == (
        "`micro_batch_size` must be a multiple of the number of devices the batch is "
        "sharded over, so that each micro-batch takes an equal part of every shard. "
        "Received: micro_batch_size=3 with batches sharded over 4 devices (mesh axis "
        "'batch' of DataParallel)"
    )
