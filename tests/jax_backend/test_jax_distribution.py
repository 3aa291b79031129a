"""keras.distribution on JAX: `DataParallel` and `ModelParallel` on 2 and 4 virtual
CPU devices, each exact against one device. Each device of the batch axis keeps its
own sums (`sums="local"`: a row each, added once per update) or 1/N of them
(`sums="sharded"`: reduce-scattered per micro-batch, gathered per update), laid out
with its variable's own sharding; the compiled step's collectives are read from its
HLO (`benchmarks/hlo.py`). Models whose sums cannot be kept per device are reduced
per micro-batch, with a warning that says why.

JAX fixes its devices when it starts, so each device count runs in a child process
(`distribution_job.py`, with `--xla_force_host_platform_device_count=N`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

JOB = pathlib.Path(__file__).with_name("distribution_job.py")
CASES = [
    (model, options, kind)
    for model in ("mlp", "tokens")
    for options in ("steps", "micro_batch_size", "steps sharded", "micro_batch_size sharded")
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
        sharded = case["options"].get("sums") == "sharded"
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
            if sharded and rows > 1 and sharding["accumulator_shape"] == sharding["shape"]:
                # 1/N of the sums on each device: the variable's layout with the
                # batch axis on one more dimension (the largest that divides; a
                # variable with none left, as a bias ModelParallel shards, keeps
                # rows as below).
                assert "'batch'" in sharding["accumulator"], (name, path)
                assert sharding["accumulator_shape"] == sharding["shape"], (name, path)
                held = np.prod(sharding["accumulator_shard"])
                assert held * rows == np.prod(sharding["variable_shard"]), (name, path)
                continue
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
        if case["kind"] == "model_parallel" and steps and not sharded:
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
    if rows == 1:
        return
    # Under ModelParallel each device holds half of every variable (the "model"
    # axis of 2), so it reduces half of the gradient.
    held = case["gradient_bytes"] // (2 if parallel else 1)
    if case["options"].get("sums") == "sharded":
        # sums="sharded": the gradient reduce-scattered in every micro-batch (each
        # device receives its 1/N), gathered whole once per update (a variable
        # with no dimension left to shard keeps rows, added once per update).
        gathered = sum(size for kind, size, place in found
                       if kind in ("all-gather", "all-reduce") and place == "update")
        assert gathered == held, (name, found)
        if not parallel:
            scattered = sum(size for kind, size, place in found
                            if kind == "reduce-scatter" and place != "update")
            # (Split mode's batch of 12: a micro-batch of 8 and the last of 4.)
            micro_batches = 2 if "micro_batch_size" in case["options"] else 1
            assert scattered * rows == held * micro_batches, (name, found)
            assert not [c for c in found if c[0] == "all-reduce" and c[1] > 16], name
        return
    update = sum(size for kind, size, place in found
                 if kind == "all-reduce" and place == "update")
    assert update == held, (name, found)
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


def test_the_noise_scale_counts_each_devices_share_as_a_piece(jobs):
    found = _results(jobs, 4)["noise_scale"]
    # Each estimate within 15 % of the truth; per-device sums ("local", "sharded")
    # read the same pieces (each device's share of each micro-batch, 16 per
    # window), "reduced" the micro-batches (4), as one device does.
    truth = found.pop("truth")
    for name, estimate in found.items():
        assert abs(estimate / truth - 1) < 0.15, (name, estimate, truth)
    np.testing.assert_allclose(found["sharded"], found["local"], rtol=1e-4)
    np.testing.assert_allclose(found["reduced"], found["one_device"], rtol=1e-4)
    assert abs(found["local"] - found["one_device"]) > 1e-3 * truth
    # A window of one micro-batch of 64 measures through its devices' shares of 16:
    # one device's micro-batches of 16, exactly. Split mode's micro-batches of 16
    # are cut in 4 shares each, as "local"'s are.
    np.testing.assert_allclose(found["steps_1"], found["one_device"], rtol=1e-4)
    np.testing.assert_allclose(found["split"], found["local"], rtol=1e-4)


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
    # Variants under DataParallel on 4 devices: exact against one device, each
    # device's sums its own where the model allows, else reduced per micro-batch
    # with a warning that says why.
    variants = results["variants"]
    fallback = ("gradaccum all-reduces each micro-batch's gradient under DataParallel "
                "(4 devices on mesh axis 'batch'): {}, so its sums cannot be kept per "
                "device. An update then costs one gradient all-reduce per micro-batch, "
                "as Keras's own step does.")
    reasons = {
        "regularized": None,  # a weight regularizer: every device adds it alike
        "activity": "its forward pass adds losses computed from the samples (an "
                    "activity regularizer, `add_loss`)",
        "own_compute_loss": "the model's own `compute_loss` may compare its samples "
                            "with each other or add terms computed from them",
        "uniform": "weighting='uniform' leaves each device's share of the loss unknown "
                   '(weighting="exact" reads it from the compiled loss)',
        "reduction_sum": 'reduction="sum" leaves each device\'s share of the loss '
                         "unknown (a summed loss adds up over the devices, a mean one "
                         "does not)",
        "dropout_reduced": None,
    }
    for name, reason in reasons.items():
        found = variants[name]
        assert found["gap"] < 1e-6 and found["loss_gap"] < 1e-5, (name, found)
        assert found["warnings"] == ([] if reason is None else [fallback.format(reason)])
    # Found while tracing with sums="sharded": the sums stay sharded, the gradient
    # is all-reduced per micro-batch.
    found = variants["activity_sharded"]
    assert found["gap"] < 1e-6 and found["loss_gap"] < 1e-5, found
    assert found["warnings"] == [
        "gradaccum all-reduces each micro-batch's gradient under DataParallel (4 "
        f"devices on mesh axis 'batch'): {reasons['activity']}, so the devices cannot "
        "reduce-scatter their own gradients. The sums stay sharded (1/N on each "
        "device); an update costs one gradient all-reduce per micro-batch."
    ]
    # Dropout: each device draws its own masks (as TensorFlow's replicas and DDP's
    # processes do), so it trains otherwise than one device, its seeds moving as
    # one device's; sums="reduced" draws one device's masks.
    dropout = variants["dropout"]
    assert dropout["gap"] > 1e-3 and dropout["warnings"] == [], dropout
    assert dropout["seeds_equal"] and variants["dropout_reduced"]["seeds_equal"]
    # sums="sharded" where the sums cannot be kept per device: an error, not a
    # warning (the memory asked for would not be saved).
    assert results["sharded_refusal"] == (
        '`sums="sharded"` needs each device to compute its own share of a '
        "micro-batch's gradient, which this model cannot under DataParallel (4 "
        "devices on mesh axis 'batch'): BatchNormalization layer(s) 'bn' normalize "
        'over all the devices\' samples. Received: sums="sharded"; pass sums="local" '
        '(each device keeps whole sums) or sums="reduced".'
    )
    # A KerasHub GPT2CausalLM fine-tuned on strings (padded: each device's share
    # holds its own number of tokens), each device's own sums or sharded ones.
    for sums, found in results["hub"].items():
        assert found["updates"] == 2 and found["warnings"] == [], (sums, found)
        assert found["gap"] < 1e-6, (sums, found)
    # A micro-batch size the devices cannot share equally.
    assert results["indivisible"] == (
        "`micro_batch_size` must be a multiple of the number of devices the batch is "
        "sharded over, so that each micro-batch takes an equal part of every shard. "
        "Received: micro_batch_size=3 with batches sharded over 4 devices (mesh axis "
        "'batch' of DataParallel)"
    )
