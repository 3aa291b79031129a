"""Runs of the experiment side by side: one process per CPU core, each run alone.

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


def default_jobs(tasks: int) -> int:
    """Worker processes for `tasks` runs: one per core on a CPU machine, one where an
    NVIDIA GPU is present (the runs would share it)."""
    if os.path.exists("/dev/nvidiactl"):
        return 1
    return max(1, min(cores(), tasks))


def limit_threads(backend: str, threads: int) -> None:
    """Caps the backend's CPU threads at `threads`, before Keras is imported.

    JAX (XLA's CPU client: one thread or its default, no count in between) and
    TensorFlow read their settings from the environment when they start; PyTorch's
    is set on import here.
    """
    threads = str(threads)
    os.environ["OMP_NUM_THREADS"] = threads
    if backend == "jax":
        flags = os.environ.get("XLA_FLAGS", "")
        if threads == "1":
            os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    elif backend == "tensorflow":
        os.environ["TF_NUM_INTRAOP_THREADS"] = threads
        os.environ["TF_NUM_INTEROP_THREADS"] = threads
    elif backend == "torch":
        import torch

        torch.set_num_threads(int(threads))


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


def _start_worker(backend: str, threads: int, data: Dataset) -> None:
    global _DATA
    os.environ["KERAS_BACKEND"] = backend
    limit_threads(backend, threads)
    start_backend(backend)
    _DATA = data


def _run(task: Task) -> RunResult:
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
        return results
    # Fresh interpreters (spawn): each starts its own Keras on `backend`.
    context = multiprocessing.get_context("spawn")
    threads = max(1, cores() // jobs)
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker,
        initargs=(backend, threads, data),
    ) as pool:
        futures = {pool.submit(_run, task): index for index, task in enumerate(tasks)}
        try:
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], future.result())
        except BaseException:
            # A run failed (or Ctrl-C): the runs not started yet are not started.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return results
