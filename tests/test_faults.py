"""Fault injection: a job killed with SIGKILL in the middle of a window resumes
exactly (tests/fault_job.py runs in subprocesses, bounded in time)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

JOB = pathlib.Path(__file__).with_name("fault_job.py")
TIMEOUT = 240


def run_job(mode, directory, out, kill_at=0):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    job, _, variant = mode.partition("-")
    command = [sys.executable, str(JOB), job, "--dir", str(directory), "--out", str(out)]
    if variant == "schedule":
        command.append("--schedule")
    if kill_at:
        command += ["--kill-at", str(kill_at)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def weights(path):
    with np.load(path) as saved:
        return [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of an uninterrupted run, per mode (computed once, in this
    process: the same job as the subprocesses run, without their start-up)."""
    import fault_job

    cache = {}

    def get(mode):
        if mode not in cache:
            job, _, variant = mode.partition("-")
            run = fault_job.run_fit if job == "fit" else fault_job.run_loop
            steps = fault_job.SCHEDULE if variant == "schedule" else fault_job.STEPS
            folder = tmp_path_factory.mktemp(f"whole_{mode}")
            cache[mode] = run(str(folder / "backup"), 0, steps).get_weights()
        return cache[mode]

    return get


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
# Micro-batch 7 is the second of epoch 2's first (full) window; 9 the first of its
# second (partial) window, under fit (the loop, whose checkpoint is a
# tf.train.CheckpointManager's, is killed in a full window here; a checkpoint read
# back in the middle of a window: test_accumulator.py's checkpoint tests).
@pytest.mark.parametrize("mode, kill_at", [("fit", 7), ("loop", 7), ("fit", 9)])
def test_sigkill_in_the_middle_of_a_window_then_rerun_equals_an_uninterrupted_run(
    tmp_path, uninterrupted, mode, kill_at
):
    killed = run_job(mode, tmp_path / "backup", tmp_path / "never.npz", kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "never.npz").exists()

    resumed = run_job(mode, tmp_path / "backup", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = uninterrupted(mode), weights(tmp_path / "resumed.npz")
    assert len(expected) == len(got) == 4
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
@pytest.mark.parametrize("mode", ["fit-schedule", "loop-schedule"])
def test_sigkill_in_a_scheduled_run_then_rerun_continues_the_schedule(
    tmp_path, uninterrupted, mode
):
    # The ramp [(0, 1), (2, 2), (4, 4)] over epochs of 5 micro-batches: epoch 1 makes
    # updates 0-3 (1, 1, 2, a flushed 1); micro-batch 7 is the second of update 4's
    # window of 4, which the rerun must know from the restored schedule position.
    killed = run_job(mode, tmp_path / "backup", tmp_path / "never.npz", kill_at=7)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_job(mode, tmp_path / "backup", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = uninterrupted(mode), weights(tmp_path / "resumed.npz")
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The schedule shaped the run: windows of 3 end elsewhere.
    fixed = uninterrupted(mode.split("-")[0])
    assert max(float(np.abs(a - b).max()) for a, b in zip(expected, fixed)) > 1e-3
