"""Split mode on Keras's JAX backend (issue 30): memory and throughput of
`accumulate(model, micro_batch_size=b)` trained with `fit(batch_size=B)`.

    KERAS_BACKEND=jax python benchmarks/jax_split.py    # the tables (~5 min)
    KERAS_BACKEND=jax python benchmarks/jax_split.py --quick    # a smoke run

Workloads: `transformer` of benchmarks/workloads.py (embedding, 4-head attention,
dense, layer norms; sequences of 64 tokens) and the MLP of benchmarks/jax_builtin.py
(784-512-512-10); Adam, sparse cross-entropy. Each in four runs: plain fit at b,
split mode (fit at B, micro-batches of b), plain fit at B, and `steps=B/b` at b.

Memory, two ways:
- XLA's accounting of the compiled train step. After a one-batch fit (the state
  exists: optimizer slots, accumulators), `model.train_step` is jitted as Keras jits
  it (the state donated), lowered for the run's batch shape and compiled;
  `memory_analysis()` gives the arguments (the training state and the input batch),
  the outputs (the new state, aliased to the donated state) and the temporaries
  (the step's working memory). The step's peak is arguments + outputs - aliased +
  temporaries.
- The peak resident set (VmHWM) of a fresh process that trains one epoch of B
  samples, for reference (on CPU it is mostly the runtime: Keras's data adapters
  import TensorFlow).

`--probe` (on in a full run): the split step compiled again with
`nonfinite="apply"` (no finiteness check), to show what the default check
(`nonfinite="skip"`) costs in temporaries. (Before commit 68f461c it also compiled
the step with the window's reset made opaque to XLA; since the state keeps no sums
in split mode that reset no longer touches them and the probe was dropped.)

Throughput: split (fit at B, micro-batches of b) against `steps=B/b` (fit at b) on
the same data, `--updates` updates of B samples per timed fit, interleaved
`--repeats` times after a warm-up fit that compiles; the median samples/s and the
median of the per-repeat ratios. Both start from the same weights and train on the
same batches in the same windows: their weights are compared after the last repeat.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WORKLOADS = ("transformer", "mlp")
RUNS = ("plain_b", "split", "plain_B", "steps")
MIB = 2**20


def labels(B: int, b: int) -> dict:
    return {
        "plain_b": f"plain fit, batch {b}",
        "split": f"split: fit(batch_size={B}), micro_batch_size={b}",
        "plain_B": f"plain fit, batch {B}",
        "steps": f"steps={B // b}, fit(batch_size={b})",
    }


def build(workload: str):
    import keras

    if workload == "mlp":  # benchmarks/jax_builtin.py's
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ])
    import workloads

    return workloads.build(workload)


def data(workload: str, n: int):
    if workload == "mlp":
        import jax_builtin

        return jax_builtin.data(n)
    import workloads

    return workloads.data(workload, n)


def make(workload: str, run: str, B: int, b: int, **options):
    """The run's model, compiled, and the batch size fit trains it with."""
    import keras

    import gradaccum

    model = build(workload)
    batch = {"plain_b": b, "split": B, "plain_B": B, "steps": b}[run]
    if run == "split":
        model = gradaccum.accumulate(model, micro_batch_size=b, **options)
    elif run == "steps":
        model = gradaccum.accumulate(model, steps=B // b, **options)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, batch


def nbytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree_util.tree_leaves(tree))


def step_memory(workload: str, run: str, B: int, b: int, **options) -> dict:
    """XLA's memory analysis of the run's train step, compiled for its batch."""
    import jax
    import jax.numpy as jnp

    model, batch = make(workload, run, B, b, **options)
    x, y = data(workload, batch)
    # One batch: builds the optimizer, the metrics and gradaccum's state.
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    model.make_train_function()
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in model.optimizer.variables],
             [v.value for v in model.metrics_variables])
    batch_data = (jnp.asarray(x), jnp.asarray(y))
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, batch_data).compile()
    stats = compiled.memory_analysis()
    out = {
        "workload": workload, "run": run, "batch": batch,
        "input": nbytes(batch_data), "state": nbytes(state),
        "argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
        "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes,
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def probe(workload: str, B: int, b: int) -> list:
    """The split step compiled with `nonfinite="apply"` (no finiteness check)."""
    point = dict(step_memory(workload, "split", B, b, nonfinite="apply"),
                 nonfinite="apply")
    print(json.dumps(point), flush=True)
    return [point]


def memory_child(workload: str, run: str, B: int, b: int) -> None:
    model, batch = make(workload, run, B, b)
    x, y = data(workload, B)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize() / MIB
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    from jax_builtin import high_water_mib

    print(json.dumps({"before_fit_mib": before, "peak_mib": high_water_mib()}))


def rss(workload: str, run: str, B: int, b: int) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--memory-child", workload, run, str(B), str(b)],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        return {"error": result.stderr[-500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def throughput(workload: str, B: int, b: int, repeats: int, updates: int) -> dict:
    import numpy as np

    x, y = data(workload, updates * B)
    names = ("split", "steps")
    models = {}
    for name in names:
        model, batch = make(workload, name, B, b)
        model.fit(x[:B], y[:B], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        models[name] = (model, batch)
    rates = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % 2:] + names[: r % 2]:
            model, batch = models[name]
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            rates[name].append(len(x) / (time.perf_counter() - start))
        print(f"{workload} repeat {r + 1}: "
              + ", ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items()), flush=True)
    split_weights = models["split"][0].get_weights()
    steps_weights = models["steps"][0].get_weights()
    diff = max(float(np.max(np.abs(a - c))) for a, c in zip(split_weights, steps_weights))
    scale = max(float(np.max(np.abs(a))) for a in steps_weights)
    updates_done = {name: int(m.optimizer.iterations.numpy()) for name, (m, _) in models.items()}
    return {"rates": rates, "max_weight_diff": diff, "max_weight": scale,
            "updates": updates_done}


def mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def memory_tables(workload: str, points: list, peaks: dict, B: int, b: int) -> list:
    names = labels(B, b)
    base = next(p for p in points if p["run"] == "plain_b")
    lines = [
        f"XLA's memory analysis of the compiled train step, `{workload}` (MiB; ratios to "
        f"plain fit at batch {b}):",
        "",
        "| run | input batch | state | temporaries | temp / plain b | arguments | outputs"
        " not aliased | step peak | peak / plain b | peak - input | / plain b |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        beyond, base_beyond = p["peak"] - p["input"], base["peak"] - base["input"]
        lines.append(
            f"| {names[p['run']]} | {mib(p['input'])} | {mib(p['state'])} | "
            f"{mib(p['temp'])} | {p['temp'] / base['temp']:.2f} | {mib(p['argument'])} | "
            f"{mib(p['output'] - p['alias'])} | {mib(p['peak'])} | "
            f"{p['peak'] / base['peak']:.2f} | {mib(beyond)} | {beyond / base_beyond:.2f} |"
        )
    base_rss = peaks["plain_b"].get("peak_mib")
    lines += [
        "",
        f"Peak resident set of a fresh process training one epoch of {B} samples, "
        f"`{workload}` (MiB):",
        "",
        "| run | before fit | peak | / plain b |",
        "| --- | ---: | ---: | ---: |",
    ]
    for run in RUNS:
        peak = peaks[run]
        if "error" in peak:
            lines.append(f"| {names[run]} | error | {peak['error'][-80:]!r} | |")
            continue
        ratio = f"{peak['peak_mib'] / base_rss:.2f}" if base_rss else ""
        lines.append(f"| {names[run]} | {peak['before_fit_mib']:.0f} | "
                     f"{peak['peak_mib']:.0f} | {ratio} |")
    return lines


def probe_table(workload: str, rows: list, split: dict, base: dict) -> list:
    lines = [
        f"The split step's finiteness check, `{workload}` (MiB; ratios to plain fit at b):",
        "",
        "| nonfinite | temporaries | temp / plain b | step peak | peak / plain b |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in [dict(split, nonfinite="skip (default)")] + rows:
        lines.append(f"| {r['nonfinite']} | {mib(r['temp'])} | "
                     f"{r['temp'] / base['temp']:.2f} | {mib(r['peak'])} | "
                     f"{r['peak'] / base['peak']:.2f} |")
    return lines


def throughput_table(workload: str, result: dict, B: int, b: int, updates: int,
                     repeats: int) -> list:
    split, steps = result["rates"]["split"], result["rates"]["steps"]
    ratios = [s / a for s, a in zip(split, steps)]
    return [
        f"Throughput, `{workload}`: {updates} updates of {B} samples per timed fit, "
        f"{repeats} interleaved repeats (samples/s):",
        "",
        "| contender | median | repeats |",
        "| --- | ---: | --- |",
        f"| split (fit at {B}, micro_batch_size={b}) | {statistics.median(split):.0f} | "
        + ", ".join(f"{v:.0f}" for v in split) + " |",
        f"| steps={B // b} (fit at {b}) | {statistics.median(steps):.0f} | "
        + ", ".join(f"{v:.0f}" for v in steps) + " |",
        "",
        f"Split / steps, per repeat: {', '.join(f'{r:.2f}' for r in ratios)}; median "
        f"**{statistics.median(ratios):.2f}**. Weights after the last repeat: max "
        f"|split - steps| = {result['max_weight_diff']:.3g} (largest weight "
        f"{result['max_weight']:.3g}); updates made: {result['updates']['split']} "
        f"and {result['updates']['steps']}.",
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: B=256, 1 repeat")
    parser.add_argument("--batch", type=int, default=2048, help="B, the batch fit gets")
    parser.add_argument("--micro", type=int, default=32, help="b, the micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=4, help="updates per timed fit")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                        help="the split step compiled without the finiteness check too "
                             "(default: on unless --quick)")
    parser.add_argument("--memory-child", nargs=4, metavar=("WORKLOAD", "RUN", "B", "b"))
    args = parser.parse_args(argv)
    if args.memory_child:
        workload, run, B, b = args.memory_child
        memory_child(workload, run, int(B), int(b))
        return
    import jax
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit(f"Run with KERAS_BACKEND=jax (Keras runs on "
                         f"{keras.backend.backend()!r}).")
    B, b = (256, 32) if args.quick else (args.batch, args.micro)
    repeats = 1 if args.quick else args.repeats
    updates = 2 if args.quick else args.updates
    run_probe = (not args.quick) if args.probe is None else args.probe
    started = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    out = [f"Keras {keras.__version__}, JAX {jax.__version__}, {os.cpu_count()} CPUs; "
           f"B = {B}, b = {b}"]
    for workload in args.workloads.split(","):
        points = []
        for run in RUNS:
            points.append(step_memory(workload, run, B, b))
            print(json.dumps(points[-1]), flush=True)
        peaks = {}
        for run in RUNS:
            peaks[run] = rss(workload, run, B, b)
            print(json.dumps({"workload": workload, "run": run, **peaks[run]}), flush=True)
        out += [""] + memory_tables(workload, points, peaks, B, b)
        if run_probe:
            rows = probe(workload, B, b)
            out += [""] + probe_table(workload, rows, points[1], points[0])
        result = throughput(workload, B, b, repeats, updates)
        out += [""] + throughput_table(workload, result, B, b, updates, repeats)
    out += ["", f"({time.perf_counter() - started:.0f} s; 1-minute load average "
                f"{load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)"]
    print("\n" + "\n".join(out))


if __name__ == "__main__":
    main()
