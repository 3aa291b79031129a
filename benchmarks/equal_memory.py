"""Peak memory of benchmarks/equal.py's contenders (plain fit, Keras's built-in
accumulation, `gradaccum.accumulate`), each in a fresh process, for
`equal.py --memory`.

    KERAS_BACKEND=tensorflow python benchmarks/equal.py --memory      # the table
    python benchmarks/equal_memory.py bert,8,16 accumulate            # one process (JSON)

A process builds the contender (as equal.py compiles it, `steps_per_execution` 1),
trains one window of k micro-batches of b to trace and warm up, hands the heap that
tracing and compiling freed back to the system (`malloc_trim`: glibc keeps it
otherwise), then trains the next window while its resident set is sampled every 2 ms
(benchmarks/memory.py's sampler). Plain fit trains the same k micro-batches. On a GPU
the backend's own peak of device memory (reset after the warm-up where the backend
can) is the figure read instead.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import cells  # noqa: E402


def peak(workload: str, b: int, k: int, name: str) -> dict:
    """Contender `name`'s memory in this process, in MiB: the resident set before the
    measured window and its peak during it, and on a GPU the device's peak."""
    import ctypes
    import ctypes.util

    import workloads
    from memory import PeakSampler, rss_mib

    arrays = workloads.fit_data(workload, k * b)
    train = cells.make(name, workload, b, k, 1)
    train(arrays)
    # What tracing and compiling freed goes back to the system, so that the window
    # measured next sees what training holds and takes.
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    device_peak(reset=True)
    before = rss_mib()
    sampler = PeakSampler()
    sampler.start()
    train(arrays)
    result = {"rss_before_mib": round(before, 1), "peak_rss_mib": round(sampler.stop(), 1)}
    device = device_peak()
    if device is not None:
        result["device_peak_mib"] = round(device, 1)
    return result


def device_peak(reset: bool = False):
    """The backend's peak of GPU memory in MiB (None on a CPU); `reset` starts it anew
    where the backend can (JAX cannot: its peak is the process's)."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return torch.cuda.max_memory_allocated() / 2**20
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "gpu":
            return None
        return device.memory_stats()["peak_bytes_in_use"] / 2**20
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        return None
    if reset:
        tf.config.experimental.reset_memory_stats("GPU:0")
    return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20


CONTENDERS = ("plain", "builtin", "accumulate")


def compare(workloads_, batches, steps, repeats: int) -> list[dict]:
    """Each contender's `peak` in fresh processes, `repeats` each, interleaved."""
    rows = []
    for workload in workloads_:
        for b in batches:
            for k in steps:
                started = time.perf_counter()
                peaks = {name: [] for name in CONTENDERS}
                for _ in range(repeats):
                    for name in CONTENDERS:
                        out = subprocess.run(
                            [sys.executable, __file__, f"{workload},{b},{k}", name],
                            capture_output=True, text=True)
                        if out.returncode != 0:
                            print(f"{workload} b={b} k={k} {name} failed:\n"
                                  f"{out.stderr[-2000:]}", flush=True)
                            continue
                        peaks[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                rows.append({"workload": workload, "b": b, "k": k, "peaks": peaks})
                print(f"{workload} b={b} k={k}: " + ", ".join(
                    f"{name} {_peak_of(runs):.0f} MiB" for name, runs in peaks.items()
                    if runs) + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def _peak_of(runs: list[dict]):
    """The median peak of a contender's runs: the device's where there is one."""
    if not runs:
        return None
    key = "device_peak_mib" if "device_peak_mib" in runs[0] else "peak_rss_mib"
    return statistics.median(run[key] for run in runs)


def table(rows: list[dict]) -> str:
    device = any("device_peak_mib" in run for row in rows for runs in row["peaks"].values()
                 for run in runs)
    what = "GPU memory (the backend's peak)" if device else "resident set"
    out = [f"Peak {what} in MiB, each contender a fresh process.", "",
           "| workload | b | k | plain fit | built-in | accumulate | accumulate / plain fit | "
           "built-in / plain fit |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        peaks = {name: _peak_of(runs) for name, runs in row["peaks"].items()}

        def show(name, peaks=peaks):
            return "failed" if peaks[name] is None else f"{peaks[name]:.0f}"

        def over_plain(name, peaks=peaks):
            if peaks[name] is None or peaks["plain"] is None:
                return "-"
            return f"{peaks[name] / peaks['plain']:.3f}"

        out.append(f"| {row['workload']} | {row['b']} | {row['k']} | {show('plain')} | "
                   f"{show('builtin')} | {show('accumulate')} | {over_plain('accumulate')} | "
                   f"{over_plain('builtin')} |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    lines = []
    for name, label in (("accumulate", "accumulate"), ("builtin", "built-in")):
        values = [_peak_of(r["peaks"][name]) / _peak_of(r["peaks"]["plain"]) for r in rows
                  if r["peaks"][name] and r["peaks"]["plain"]]
        if values:
            goal = (f"{cells.count(values, 1.05, at_least=False)}" if name == "accumulate"
                    else f"median {statistics.median(values):.3f}.")
            lines.append(f"- Peak memory, {label} / plain fit (k = "
                         f"{', '.join(str(k) for k in sorted({r['k'] for r in rows}))}): "
                         f"{goal}")
    return "\n".join(lines)


def main(argv=None):
    cell, name = argv if argv is not None else sys.argv[1:]
    workload, b, k = cell.split(",")
    print(json.dumps(peak(workload, int(b), int(k), name)))


if __name__ == "__main__":
    main()
