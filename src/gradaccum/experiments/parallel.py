"""Runs of the experiment side by side: one process per CPU core (a few sharing a
GPU), each run alone.

A run of the seed experiment is a millisecond-step MLP: one process keeps about one
core busy (Python hands each micro-batch to the backend). The runs of a sweep are
independent (each has its own seed), so `run_all` spreads them over `jobs` worker
processes, each with its backend's threads limited to its share of the cores. A run
gives the same result in any process: the order of the data, the initial weights and
the updates come from its seed alone.

With `jobs=1` the runs go one after another in this process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from gradaccum.experiments.data import Dataset
from gradaccum.experiments.runner import Config, RunResult, run_once


@dataclass(frozen=True)
class Task:
    """One run: a configuration, its seed, and `run_once`'s options."""

    config: Config
    seed: int
    options: dict


def cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# Runs that share one GPU: a run's step is milliseconds of Python and a few small
# kernels, so several processes keep it busy where one leaves it idle between kernels
# (on an H200, the sweep of 50 runs: 99 s in four processes, 91 s in eight).
RUNS_PER_GPU = 4
# From this many workers on, the runs go to the CPU's cores, one each, GPU or not: a
# millisecond step is as fast on a core as on the GPU, and the cores work side by side
# (on the H200's 16-core machine: the sweep in 57 s with 16 processes on the CPU).
CPU_BEATS_GPU_FROM = 10


def default_jobs(tasks: int, backend: str | None = None) -> int:
    """Worker processes for `tasks` runs: one per core where the backend computes on
    the CPU, or where there are `CPU_BEATS_GPU_FROM` cores or more; else, where it
    computes on an NVIDIA GPU (`uses_gpu`), `RUNS_PER_GPU` sharing it."""
    if (backend is not None and cores() < CPU_BEATS_GPU_FROM and uses_gpu(backend)):
        return max(1, min(RUNS_PER_GPU, cores(), tasks))
    return max(1, min(cores(), tasks))


def device_of_workers(backend: str, jobs: int) -> str:
    """Where `jobs` worker processes train: `"gpu"` where the backend computes on one
    and fewer than `CPU_BEATS_GPU_FROM` workers share it, else `"cpu"`."""
    if jobs < CPU_BEATS_GPU_FROM and uses_gpu(backend):
        return "gpu"
    return "cpu"


def uses_gpu(backend: str) -> bool:
    """Whether Keras's `backend`, as installed here, computes on an NVIDIA GPU: a GPU
    is present and the backend's build has CUDA (JAX's CUDA plugin, PyTorch's CUDA
    build, TensorFlow's CUDA libraries). Decided without starting the backend, which
    would take the GPU in this process."""
    import importlib.metadata
    import importlib.util

    if not os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES") in (
            "", "-1"):
        return False
    if backend == "jax":
        return any(importlib.util.find_spec(name) is not None for name in
                   ("jax_cuda13_plugin", "jax_cuda12_plugin"))
    if backend == "torch":
        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            return False
        # PyTorch's CPU build says so in its local version (2.13.0+cpu).
        return "+cpu" not in version and importlib.util.find_spec("torch") is not None
    if backend == "tensorflow":
        return importlib.util.find_spec("nvidia.cudnn") is not None
    return False


def place_worker(backend: str, device: str, jobs: int) -> None:
    """Before the backend starts in a worker: on the CPU the GPU is hidden from it;
    `jobs` workers sharing the GPU take memory as they need it (JAX and TensorFlow
    would take most of it at start; PyTorch does so already)."""
    if device == "cpu":
        if backend == "jax":
            os.environ["JAX_PLATFORMS"] = "cpu"
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif jobs > 1:
        if backend == "jax":
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        elif backend == "tensorflow":
            os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")


def limit_threads(backend: str, threads: int) -> None:
    """Caps the backend's CPU threads at `threads`, before Keras is imported.

    JAX (XLA's CPU client: one thread or its default, no count in between) and
    TensorFlow read their settings from the environment when they start; PyTorch's
    is set on import here.
    """
    count = str(threads)
    os.environ["OMP_NUM_THREADS"] = count
    if backend == "jax":
        flags = os.environ.get("XLA_FLAGS", "")
        if count == "1":
            os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    elif backend == "tensorflow":
        os.environ["TF_NUM_INTRAOP_THREADS"] = count
        os.environ["TF_NUM_INTEROP_THREADS"] = count
    elif backend == "torch":
        import torch

        torch.set_num_threads(int(count))


@contextlib.contextmanager
def _quiet_stderr():
    """Sends what C++ code writes to stderr (file descriptor 2) nowhere while the
    block runs, and shows it if the block fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def start_backend(backend: str) -> None:
    """Starts the backend's runtime here, before the first run: on TensorFlow
    without its start-up lines (absl's and CUDA's probing, which TF_CPP_MIN_LOG_LEVEL
    does not hold back) or its retracing warnings, and on JAX with the compilation
    cache."""
    if backend == "tensorflow":
        with _quiet_stderr():
            import tensorflow as tf

            tf.config.list_logical_devices()
        # Each run builds its model afresh: TensorFlow's warning that functions are
        # traced again is expected here.
        tf.get_logger().setLevel("ERROR")
    compilation_cache(backend)


def compilation_cache(backend: str) -> None:
    """On JAX, keeps XLA's compiled programs in gradaccum's cache folder: every run of
    a configuration traces the same program, and compiles it once (about 1.3 s a run
    on a 2-core CPU; BENCHMARKS.md). Other backends keep none across processes."""
    if backend != "jax":
        return
    import jax

    from gradaccum.experiments.data import default_cache_dir

    jax.config.update("jax_compilation_cache_dir",
                      str(default_cache_dir() / "jax-compilation"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_DATA: Dataset | None = None


def _start_worker(backend: str, threads: int, data: Dataset, jobs: int, device: str) -> None:
    global _DATA
    os.environ["KERAS_BACKEND"] = backend
    place_worker(backend, device, jobs)
    limit_threads(backend, threads)
    start_backend(backend)
    _DATA = data


def _run(task: Task) -> RunResult:
    assert _DATA is not None, "set in each worker by _start_worker"
    return run_once(task.config, _DATA, seed=task.seed, **task.options)


def run_all(
    tasks: Sequence[Task],
    data: Dataset,
    *,
    backend: str,
    jobs: int = 1,
    on_run: Callable[[int, RunResult], None] | None = None,
) -> list[RunResult]:
    """Runs every task and returns their results in the tasks' order.

    Args:
        tasks: the runs.
        data: the digits (sent once to each worker).
        backend: Keras's backend for the workers (this process's, with `jobs=1`).
        jobs: worker processes; 1 runs the tasks here, one after another.
        on_run: called as `on_run(index, result)` when a run ends (in the order they
            end).
    """
    results: list[RunResult | None] = [None] * len(tasks)

    def done(index: int, result: RunResult) -> None:
        results[index] = result
        if on_run is not None:
            on_run(index, result)

    if jobs <= 1 or len(tasks) <= 1:
        start_backend(backend)
        for index, task in enumerate(tasks):
            done(index, run_once(task.config, data, seed=task.seed, **task.options))
        return cast("list[RunResult]", results)  # every index filled by `done`
    # Fresh interpreters (spawn): each starts its own Keras on `backend`.
    context = multiprocessing.get_context("spawn")
    threads = max(1, cores() // jobs)
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker,
        initargs=(backend, threads, data, jobs, device_of_workers(backend, jobs)),
    ) as pool:
        futures = {pool.submit(_run, task): index for index, task in enumerate(tasks)}
        try:
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], future.result())
        except BaseException:
            # A run failed (or Ctrl-C): the runs not started yet are not started.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return cast("list[RunResult]", results)  # every index filled by `done`
