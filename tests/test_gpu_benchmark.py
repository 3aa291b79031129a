"""benchmarks/gpu.py (issue 54's GPU cell) runs end to end at its --tiny size on the
JAX and PyTorch backends, each in a process of its own, and writes its JSON lines."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"
CONTENDERS = {"plain", "builtin", "accumulate", "plain_kb"}

# The tiers are tests/tiers.py's convention; until this module has its rows there
# (SLOW, SUBPROCESS, HUB), it carries its markers itself.

BACKENDS = [
    "jax",
    pytest.param("torch", marks=pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch is not installed")),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_run_reports_every_contender_and_the_ratios(backend, tmp_path):
    out = tmp_path / "gpu.jsonl"
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"KERAS_BACKEND={backend}: training on " in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["backend"] for row in rows} == {backend}
    assert len({row["run"] for row in rows}) == 1
    rates = [row for row in rows if row["kind"] == "rate"]
    assert {row["contender"] for row in rates} == CONTENDERS
    assert all(row["samples_per_s"] > 0 for row in rates)
    # The same samples an epoch for every contender, plain_kb at k * b.
    assert len({row["samples"] for row in rates}) == 1
    batches = {row["contender"]: row["batch"] for row in rates}
    assert batches["plain_kb"] == batches["plain"] * rows[0]["config"]["steps"]
    ratios = {row["ratio"]: row for row in rows if row["kind"] == "ratio"}
    for name in ("accumulate/plain", "accumulate/builtin"):
        assert ratios[name]["median"] > 0
        assert ratios[name]["min"] <= ratios[name]["median"] <= ratios[name]["max"]
    assert "accumulate / builtin:" in run.stdout


def test_other_backends_are_refused_with_a_clear_message():
    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "KERAS_BACKEND=jax or KERAS_BACKEND=torch" in run.stderr
