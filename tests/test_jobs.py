"""The main job's worker processes follow the device the backend computes on
(issue 54): one per core on a CPU, `RUNS_PER_GPU` sharing a GPU where the cores are
few, whatever a GPU's mere presence says."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest

from gradaccum.experiments import parallel


@pytest.fixture
def machine(monkeypatch):
    """A machine of 16 cores with or without an NVIDIA GPU, and the packages found."""
    state = {"gpu": True, "modules": set(), "torch": "2.11.0"}
    exists = os.path.exists
    monkeypatch.setattr(parallel, "cores", lambda: 16)
    monkeypatch.setattr(os.path, "exists", lambda path: state["gpu"] if path == "/dev/nvidiactl"
                        else exists(path))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name in state["modules"] | {"torch"} else None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: state["torch"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


def test_cpu_only_jax_on_a_gpu_machine_runs_one_process_per_core(machine, monkeypatch):
    monkeypatch.setattr(parallel, "cores", lambda: 8)
    assert parallel.default_jobs(40, "jax") == 8
    assert parallel.device_of_workers("jax", 8) == "cpu"
    machine["modules"] = {"jax_cuda12_plugin"}
    assert parallel.uses_gpu("jax")
    assert parallel.default_jobs(40, "jax") == parallel.RUNS_PER_GPU == 4
    assert parallel.device_of_workers("jax", 4) == "gpu"
    assert parallel.default_jobs(2, "jax") == 2


def test_many_cores_beat_a_shared_gpu(machine):
    # 16 cores: the sweep took 57 s on them, 91-99 s in 4-8 processes on the GPU.
    machine["modules"] = {"jax_cuda12_plugin"}
    assert parallel.default_jobs(40, "jax") == 16
    assert parallel.device_of_workers("jax", 16) == "cpu"
    assert parallel.device_of_workers("jax", 4) == "gpu"


def test_torch_and_tensorflow_builds(machine, monkeypatch):
    assert parallel.uses_gpu("torch")
    machine["torch"] = "2.13.0+cpu"
    assert not parallel.uses_gpu("torch")
    assert not parallel.uses_gpu("tensorflow")
    machine["modules"] = {"nvidia.cudnn"}
    assert parallel.uses_gpu("tensorflow")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not parallel.uses_gpu("tensorflow")


def test_no_gpu_no_sharing(machine):
    machine["gpu"] = False
    machine["modules"] = {"jax_cuda12_plugin"}
    assert not parallel.uses_gpu("jax")
    assert parallel.default_jobs(40, "jax") == 16
    assert parallel.default_jobs(3) == 3


def test_workers_on_the_cpu_hide_the_gpu_and_sharing_ones_take_memory_as_needed(
        monkeypatch):
    monkeypatch.setattr(os, "environ", {})
    parallel.place_worker("jax", "gpu", 1)
    assert os.environ == {}
    parallel.place_worker("jax", "gpu", 4)
    parallel.place_worker("tensorflow", "gpu", 4)
    assert os.environ == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                          "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    monkeypatch.setattr(os, "environ", {})
    parallel.place_worker("jax", "cpu", 16)
    parallel.place_worker("torch", "cpu", 16)
    assert os.environ == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
