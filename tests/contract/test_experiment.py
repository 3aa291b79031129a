"""The seed experiment on every backend (this module runs in each backend's process):
`gradaccum sweep` in this process, and in two worker processes of this backend.

The configurations of a sweep share their seeds: run i of 1x20, 4x5 and 20x1 starts
from the same weights and sees the same samples in the same order, so exact
accumulation gives them the same updates up to float rounding, and the same accuracy
up to a digit that rounding flips.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from gradaccum import cli
from gradaccum._backend import NAMES

BACKEND = keras.backend.backend()
# One test digit of the 300 (a digit on the boundary that float rounding flips).
DIGIT = 100.0 / 300


SWEEP = ["sweep", "--configs", "1x20,4x5,20x1", "--updates", "15", "--runs", "2",
         "--evaluations", "3", "--no-contrast"]


def accuracies(out):
    rows = json.loads((out / "results.json").read_text())["configs"]
    return {row["label"]: [run["accuracy"] for run in row["runs"]] for row in rows}


@pytest.fixture(scope="module")
def in_this_process(small_npz, tmp_path_factory):
    """The sweep run once in this process (`--jobs 1`): its folder and printed lines,
    which both tests read (the suite's time: one sweep, not two)."""
    out = tmp_path_factory.mktemp("jobs1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main([*SWEEP, "--data", str(small_npz), "--jobs", "1", "--out", str(out)])
    assert code == 0
    return out, printed.getvalue().splitlines()


def test_a_sweep_on_this_backend_gives_the_splits_the_same_accuracy_run_by_run(
        in_this_process):
    tmp_path, lines = in_this_process
    assert lines[0].startswith("data: mnist (")
    assert lines[1].endswith(f"seed 0; {NAMES[BACKEND]}, 1 process")
    runs = accuracies(tmp_path)
    assert set(runs) == {"1x20", "4x5", "20x1"}
    for label in ("4x5", "20x1"):
        np.testing.assert_allclose(runs[label], runs["1x20"], atol=DIGIT + 1e-9)
    assert all(a > 40.0 for a in runs["1x20"])  # 15 updates; chance is 10%
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["settings"]["backend"] == BACKEND
    curve = result["configs"][1]["runs"][0]["curve"]
    assert [u for u, _ in curve] == [5, 10, 15]


def test_runs_in_two_processes_give_the_results_of_one_and_print_no_start_up_lines(
        in_this_process, small_npz, tmp_path):
    """`--jobs 2`: two fresh interpreters on this backend, each run's result that of
    the same run in this process; stderr stays empty (no library start-up lines)."""
    one, two = in_this_process[0], tmp_path / "jobs2"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(
        [sys.executable, "-m", "gradaccum", *SWEEP, "--data", str(small_npz), "--backend",
         BACKEND, "--jobs", "2", "--out", str(two)],
        capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines()[0].startswith("data: mnist (")
    assert done.stdout.splitlines()[1].endswith(f"{NAMES[BACKEND]}, 2 processes")
    in_this, in_two = accuracies(one), accuracies(two)
    for label in in_this:
        np.testing.assert_allclose(in_two[label], in_this[label], atol=DIGIT + 1e-9)
