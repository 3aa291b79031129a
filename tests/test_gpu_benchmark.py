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

# Every contender on PyTorch (eager: seconds); on JAX, whose tiny run compiles each
# contender (10 s apiece on 2 cores), plain fit and accumulate.
BACKENDS = [
    pytest.param("jax", ("plain", "accumulate"), id="jax"),
    pytest.param("torch", tuple(sorted(CONTENDERS)), id="torch",
                 marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                          reason="torch is not installed")),
]


@pytest.mark.parametrize("backend, contenders", BACKENDS)
def test_tiny_run_reports_every_contender_and_the_ratios(backend, contenders, tmp_path):
    out = tmp_path / "gpu.jsonl"
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out),
                          "--contenders", ",".join(contenders)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"KERAS_BACKEND={backend}: training on " in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["backend"] for row in rows} == {backend}
    assert len({row["run"] for row in rows}) == 1
    rates = [row for row in rows if row["kind"] == "rate"]
    assert {row["contender"] for row in rates} == set(contenders)
    assert all(row["samples_per_s"] > 0 for row in rates)
    # The same samples an epoch for every contender, plain_kb at k * b.
    assert len({row["samples"] for row in rates}) == 1
    batches = {row["contender"]: row["batch"] for row in rates}
    if "plain_kb" in batches:
        assert batches["plain_kb"] == batches["plain"] * rows[0]["config"]["steps"]
    ratios = {row["ratio"]: row for row in rows if row["kind"] == "ratio"}
    names = ["accumulate/plain"] + (["accumulate/builtin"] if "builtin" in contenders else [])
    for name in names:
        assert ratios[name]["median"] > 0
        assert ratios[name]["min"] <= ratios[name]["median"] <= ratios[name]["max"]
    assert "accumulate / plain:" in run.stdout


def test_other_backends_are_refused_with_a_clear_message():
    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "KERAS_BACKEND=jax or KERAS_BACKEND=torch" in run.stderr
