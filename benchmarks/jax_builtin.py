"""gradaccum against Keras's own `gradient_accumulation_steps` on Keras's JAX backend.

    KERAS_BACKEND=jax python benchmarks/jax_builtin.py            # the tables (~5 min)
    KERAS_BACKEND=jax python benchmarks/jax_builtin.py --quick    # a smoke run
    KERAS_BACKEND=jax python benchmarks/jax_builtin.py --memory-only    # the memory row

Throughput: both contenders train the same MLP (784-512-512-10, Adam) on the same
synthetic data with the same micro-batch b, window k and `steps_per_execution` (= k),
through `fit`, in one process, interleaved, `--repeats` times; the median samples/s of
a timed epoch (after a warm-up epoch that compiles) is reported, and the ratio
gradaccum / built-in. Memory: the peak resident memory of a fresh process that trains
one epoch of an effective batch B = b x k (the second column of the memory table),
read by the child itself from VmHWM in /proc/self/status (not `ru_maxrss`, which on
Linux keeps the parent's high-water mark across fork and exec). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONTENDERS = ("builtin", "gradaccum")


def mlp():
    """The MLP both contenders train (784-512-512-10), seeded."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])


def make_model(contender: str, k: int):
    import keras

    import gradaccum

    model = mlp()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if contender == "builtin":
        model.compile(keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k), loss,
                      steps_per_execution=k)
    else:
        model = gradaccum.accumulate(model, steps=k)
        model.compile(keras.optimizers.Adam(1e-3), loss, steps_per_execution=k)
    return model


def data(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 784)).astype("float32"),
            rng.integers(0, 10, size=(n,)).astype("int32"))


def throughput(b: int, k: int, samples: int, repeats: int) -> dict:
    x, y = data(samples)
    models = {name: make_model(name, k) for name in CONTENDERS}
    for model in models.values():  # warm-up: compiles the step
        model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    rates = {name: [] for name in CONTENDERS}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
            rates[name].append(samples / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def memory_child(contender: str, b: int, k: int) -> None:
    x, y = data(b * k)
    model = make_model(contender, k)
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    print(json.dumps({"peak_mib": high_water_mib()}))


def high_water_mib() -> float:
    """This process's peak resident set: VmHWM, not `ru_maxrss`, which on Linux
    keeps the parent's high-water mark across fork and exec (a child started by a
    parent that trained already reads the parent's peak)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def memory(b: int, k: int) -> dict:
    out = {}
    for name in CONTENDERS:
        result = subprocess.run(
            [sys.executable, __file__, "--memory-child", name, str(b), str(k)],
            capture_output=True, text=True, check=True,
        )
        out[name] = json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory table (no throughput)")
    parser.add_argument("--memory-child", nargs=3, metavar=("CONTENDER", "B", "K"))
    args = parser.parse_args(argv)
    if args.memory_child:
        name, b, k = args.memory_child
        memory_child(name, int(b), int(k))
        return
    import jax
    import keras

    samples = 2048 if args.quick else 8192
    repeats = 1 if args.quick else args.repeats
    print(f"Keras {keras.__version__}, JAX {jax.__version__}, {os.cpu_count()} CPUs"
          + ("" if args.memory_only
             else f"; {samples} samples per timed epoch, median of {repeats}"))
    if not args.memory_only:
        print("\n| b | k | built-in (samples/s) | gradaccum (samples/s) | "
              "gradaccum / built-in |")
        print("| --- | --- | --- | --- | --- |")
        for b in (8, 32):
            k = 4
            rates = throughput(b, k, samples, repeats)
            print(f"| {b} | {k} | {rates['builtin']:.0f} | {rates['gradaccum']:.0f} | "
                  f"{rates['gradaccum'] / rates['builtin']:.2f}x |", flush=True)
    b, k = (32, 8) if args.quick else (32, 64)
    peaks = memory(b, k)
    print("\n| effective batch B | split | built-in peak (MiB) | gradaccum peak (MiB) | "
          "gradaccum / built-in |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {b * k} | {b} x {k} | {peaks['builtin']:.0f} | {peaks['gradaccum']:.0f} | "
          f"{peaks['gradaccum'] / peaks['builtin']:.2f}x |")


if __name__ == "__main__":
    main()
