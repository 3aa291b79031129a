"""JAX across two processes (issue 43, item 4): `jax.distributed` on localhost
through `keras.distribution.initialize`, Keras's `DataParallel` over one CPU device
in each process, each feeding its half of every global batch
(`processes_job.py`). `accumulate` is exact against one process on the global
windows; `Privacy` draws the same noise in both processes (a seed given, or the one
process 0 drew, broadcast), equal to one process's with the same seed. Two
processes SIGKILLed in the middle of a window after a save (one, then the other,
as a scheduler tears the job down), and two new ones resumed from it, end as one
process trained without a stop."""

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
from largebatch import SCE, data, mlp

import gradaccum

JOB = pathlib.Path(__file__).with_name("processes_job.py")
CONTRACT = JOB.parent.parent / "contract"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(*args) -> list:
    """Both processes of one job; their JSON outputs."""
    port = str(_free_port())
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(CONTRACT), *sys.path]))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    jobs = [subprocess.Popen([sys.executable, str(JOB), str(p), port, *map(str, args)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for p in range(2)]
    outputs = []
    for job in jobs:
        try:
            out, err = job.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in jobs:
                other.kill()
            raise
        killed = args[0] == "train"
        assert job.returncode == (-9 if killed else 0), err[-3000:]
        outputs.append([json.loads(line) for line in out.strip().splitlines()
                        if line.startswith("{")])
    return outputs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("processes")


@pytest.fixture(scope="module")
def job(folder):
    """The training job (killed at its end, mid-window, after a save): per
    process, its results and the update count it was killed at."""
    return _run("train", folder)


@pytest.fixture(scope="module")
def results(job):
    return [lines[0] for lines in job]


def _one_process(options):
    """One process trained on the global batches (8 samples) of the same data."""
    x, y = data(48)
    model = gradaccum.accumulate(mlp(0), **options)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def _close(a, b, rtol=1e-5, atol=1e-6):
    for p, q in zip(a, b):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", ["steps", "sharded"])
def test_two_processes_train_as_one_on_the_global_windows(results, mode):
    # 2 processes of 4 devices: the batch sharded over 8. "steps": each device
    # keeps its own sums; "sharded": 1/8 of them.
    assert [r["devices"] for r in results] == [8, 8]
    assert [r["processes"] for r in results] == [2, 2]
    first, second = (r[mode] for r in results)
    # 6 global batches per epoch in windows of 3: 2 updates an epoch.
    assert first["updates"] == second["updates"] == [2.0, 4.0]
    _close(first["weights"], second["weights"], rtol=0, atol=0)
    reference = _one_process(dict(steps=3))
    moved = max(float(np.abs(np.asarray(a) - b).max())
                for a, b in zip(first["weights"], mlp(0).get_weights()))
    assert moved > 1e-2
    _close(first["weights"], reference)


def test_sharded_sums_hold_an_eighth_on_each_device(results):
    # The MLP's kernels split over the 8 devices; a bias no 8 divides keeps a row
    # per device (its whole size on each).
    for r in results:
        held = r["sharded_held"]
        model = mlp(0)
        expected = sum(int(np.prod(w.shape)) // 8 if any(d % 8 == 0 for d in w.shape)
                       else int(np.prod(w.shape)) for w in model.get_weights())
        assert held["held"] == expected < held["parameters"] / 2


def test_privacy_draws_the_same_noise_in_both_processes(results):
    privacy = dict(l2_norm_clip=1.0, noise_multiplier=0.5)
    seeded = [r["private_seeded"]["weights"] for r in results]
    _close(seeded[0], seeded[1], rtol=0, atol=0)
    reference = _one_process(dict(steps=3, privacy=gradaccum.Privacy(**privacy, seed=3)))
    _close(seeded[0], reference)
    # No seed: process 0 draws one and both use it.
    drawn = [r["private"]["weights"] for r in results]
    _close(drawn[0], drawn[1], rtol=0, atol=0)
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(drawn[0], seeded[0])) > 1e-4


def test_a_process_killed_mid_window_and_both_resumed_end_exactly(job, folder):
    # 5 global batches with windows of 3 carried: one update, 2 micro-batches open
    # when the processes are killed; the new processes finish the epoch's 6th batch.
    assert [lines[-1]["iterations"] for lines in job] == [1, 1]
    both = [lines[-1] for lines in _run("resume", folder)]
    x, y = data(48)
    reference = gradaccum.accumulate(mlp(0), steps=3, partial="carry")
    reference.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # Each device's own sums, and sharded ones, saved with the window open.
    for sums in ("local", "sharded"):
        resumed = [r[sums] for r in both]
        assert [r["iterations"] for r in resumed] == [2, 2]
        _close(resumed[0]["weights"], resumed[1]["weights"], rtol=0, atol=0)
        _close(resumed[0]["weights"], reference.get_weights())
