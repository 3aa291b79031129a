"""gradaccum's own cost: `accumulate` against Keras's built-in accumulation and plain
`fit`, at equal settings (the same model, data, micro-batch b, window k and
`steps_per_execution`), on the Keras backend of the process.

    KERAS_BACKEND=tensorflow python benchmarks/equal.py           # the grid, printed
    KERAS_BACKEND=jax python benchmarks/equal.py --write          # and BENCHMARKS.md's table
    KERAS_BACKEND=torch python benchmarks/equal.py --write        # (steps_per_execution 1)
    python benchmarks/equal.py --workloads mlp --batches 8 --steps 4   # part of the grid
    python benchmarks/equal.py --cell mlp,8,4,4 --contender accumulate # one figure (JSON)

Contenders, each trains `n` micro-batches of b with Adam 1e-3 through `fit`:

- `plain`: plain `fit` at b (one update per micro-batch);
- `builtin`: Keras's `gradient_accumulation_steps=k` (k > 1);
- `accumulate`: `gradaccum.accumulate(model, steps=k)` (at k = 1 plain training through
  gradaccum: its sparse gradients summed, its non-finite screen);
- `unscreened` (k = 1): the same with `nonfinite="apply"`, Keras's behaviour on a
  non-finite gradient: what the screen costs.

Every cell runs at `steps_per_execution` 1 and k (micro-batches per compiled call); the
contenders of a cell live in one process and are timed interleaved, `--repeats` times,
after a warm-up epoch that traces. A figure is the median samples/s; a ratio is the
median of the per-repeat ratios (neighbours in time, so a drift of the machine cancels),
with their min and max as the spread. Nothing is asserted: the figures are read against
the targets in BENCHMARKS.md (`benchmarks/compare.py` runs the `--cell` mode of this
script on two commits).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SAMPLES = {"mlp": 8192, "cnn": 2048, "transformer": 2048}
GRID = (("mlp", "cnn", "transformer"), (8, 32, 128), (1, 4, 16))
CONTENDERS = ("plain", "builtin", "accumulate", "unscreened")


def compiled(name: str, workload: str, k: int, spe: int):
    """A model of `workload` compiled as contender `name` (Adam 1e-3)."""
    import keras
    import workloads

    model = workloads.build(workload)
    if name == "builtin":
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k)
    else:
        optimizer = keras.optimizers.Adam(1e-3)
    if name in ("accumulate", "unscreened", "unfollowed"):
        import gradaccum

        # unscreened: no non-finite screen; unfollowed: Keras's BatchNormalization
        # layers move per micro-batch (not followed through the window).
        nonfinite = "apply" if name == "unscreened" else "skip"
        moving = "micro_batch" if name == "unfollowed" else "window"
        model = gradaccum.accumulate(model, steps=k, nonfinite=nonfinite,
                                     moving_statistics=moving)
    elif name not in ("plain", "builtin"):
        raise ValueError(f"unknown contender {name!r}")
    model.compile(optimizer, workloads.loss(), steps_per_execution=spe)
    return model


def make(name: str, workload: str, b: int, k: int, spe: int):
    """A function `train(x, y)` that trains one epoch of (x, y) in micro-batches of b."""
    model = compiled(name, workload, k, spe)

    def train(x, y):
        model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)

    return train


def contenders_for(k: int) -> list[str]:
    return ["plain", "builtin", "accumulate"] if k > 1 else ["plain", "accumulate",
                                                             "unscreened"]


def measure(workload: str, b: int, k: int, spe: int, names, repeats: int,
            scale: float = 1.0) -> dict:
    """Samples/s of each contender, per repeat (interleaved, rotating the order), on
    `scale` times the workload's samples."""
    import workloads

    unit = k * spe // _gcd(k, spe)
    micro = max(unit, int(SAMPLES[workload] * scale) // b // unit * unit)
    x, y = workloads.data(workload, micro * b)
    trainers = {}
    for name in names:
        train = make(name, workload, b, k, spe)
        warm = min(micro, 2 * unit) * b
        train(x[:warm], y[:warm])
        trainers[name] = train
    rates = {name: [] for name in names}
    for r in range(repeats):
        order = list(names[r % len(names):]) + list(names[: r % len(names)])
        for name in order:
            start = time.perf_counter()
            trainers[name](x, y)
            rates[name].append(len(x) / (time.perf_counter() - start))
    return rates


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def ratio(rates: dict, top: str, bottom: str):
    """(median, min, max) of the per-repeat ratios top / bottom, or None."""
    if top not in rates or bottom not in rates:
        return None
    pairs = [a / b for a, b in zip(rates[top], rates[bottom])]
    return statistics.median(pairs), min(pairs), max(pairs)


def cells(workloads_, batches, steps, backend="tensorflow"):
    for workload in workloads_:
        for b in batches:
            for k in steps:
                # (Keras's torch trainer runs one batch per call.)
                for spe in [1] if backend == "torch" else sorted({1, k}):
                    yield workload, b, k, spe


def grid(workloads_, batches, steps, repeats: int, scale: dict,
         backend: str = "tensorflow") -> list[dict]:
    rows = []
    for workload, b, k, spe in cells(workloads_, batches, steps, backend):
        started = time.perf_counter()
        rates = measure(workload, b, k, spe, contenders_for(k), repeats,
                        scale.get(workload, 1.0))
        rows.append({"workload": workload, "b": b, "k": k, "spe": spe, "rates": rates})
        print(f"{workload} b={b} k={k} spe={spe}: " + ", ".join(
            f"{n} {statistics.median(v):.0f}" for n, v in rates.items())
            + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def _show(r) -> str:
    return "-" if r is None else f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def table(rows: list[dict]) -> str:
    out = ["| workload | b | k | steps_per_execution | plain fit | built-in | accumulate | "
           "accumulate / built-in | accumulate / plain fit | nonfinite='apply' / plain fit |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for row in rows:
        rates = row["rates"]

        def cell(name, rates=rates):
            return f"{statistics.median(rates[name]):.0f}" if name in rates else "-"

        out.append(
            f"| {row['workload']} | {row['b']} | {row['k']} | {row['spe']} | "
            f"{cell('plain')} | {cell('builtin')} | {cell('accumulate')} | "
            f"{_show(ratio(rates, 'accumulate', 'builtin'))} | "
            f"{_show(ratio(rates, 'accumulate', 'plain'))} | "
            f"{_show(ratio(rates, 'unscreened', 'plain'))} |")
    return "\n".join(out)


def summary(rows: list[dict], backend: str) -> str:
    """The cells against the targets of issue 31."""
    goal_builtin = 1.2 if backend == "jax" else 1.0
    goal_plain = 0.9 if backend == "jax" else 0.97
    vs_builtin = [ratio(r["rates"], "accumulate", "builtin")[0] for r in rows if r["k"] > 1]
    if backend == "jax":
        vs_plain = [ratio(r["rates"], "accumulate", "plain")[0] for r in rows]
        plain_what = "every cell (plain fit at b)"
    else:
        vs_plain = [ratio(r["rates"], "accumulate", "plain")[0] for r in rows if r["k"] == 1]
        plain_what = "k = 1"
    lines = []
    if vs_builtin:
        lines.append(
            f"- accumulate / built-in (k > 1): median {statistics.median(vs_builtin):.2f}, "
            f"range {min(vs_builtin):.2f}-{max(vs_builtin):.2f}; >= {goal_builtin} in "
            f"{sum(v >= goal_builtin for v in vs_builtin)} of {len(vs_builtin)} cells.")
    if vs_plain:
        lines.append(
            f"- accumulate / plain fit ({plain_what}): median "
            f"{statistics.median(vs_plain):.2f}, range {min(vs_plain):.2f}-"
            f"{max(vs_plain):.2f}; >= {goal_plain} in "
            f"{sum(v >= goal_plain for v in vs_plain)} of {len(vs_plain)} cells.")
    unscreened = [ratio(r["rates"], "unscreened", "plain")[0] for r in rows
                  if "unscreened" in r["rates"]]
    if unscreened:
        lines.append(
            f"- accumulate with nonfinite='apply' / plain fit (k = 1, no screen): median "
            f"{statistics.median(unscreened):.2f}, range {min(unscreened):.2f}-"
            f"{max(unscreened):.2f}.")
    return "\n".join(lines)


def environment(backend: str) -> str:
    import keras
    from workloads import cpu_name

    cpu = cpu_name()
    if backend == "jax":
        import jax

        version = f"JAX {jax.__version__} ({jax.default_backend()})"
    elif backend == "torch":
        import torch

        device = "GPU" if torch.cuda.is_available() else "CPU"
        version = (f"PyTorch {torch.__version__} ({device}, "
                   f"{torch.get_num_threads()} threads)")
    else:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        version = f"TensorFlow {tf.__version__} ({'GPU' if gpus else 'CPU'})"
    return (f"Machine: {os.cpu_count()} cores ({cpu}); Python {platform.python_version()}, "
            f"Keras {keras.__version__}, {version}.")


def markers(backend: str):
    return (f"<!-- generated by benchmarks/equal.py ({backend}): begin -->",
            f"<!-- generated by benchmarks/equal.py ({backend}): end -->")


def write_section(text: str, backend: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    begin, end = markers(backend)
    current = path.read_text()
    if begin not in current:
        raise SystemExit(f"BENCHMARKS.md has no section marked {begin!r}")
    head, _, rest = current.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def _ints(text):
    return [int(v) for v in text.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=GRID[0])
    parser.add_argument("--batches", type=_ints, default=GRID[1])
    parser.add_argument("--steps", type=_ints, default=GRID[2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", default="", help="more samples for some workloads, "
                        "e.g. mlp=8 (JAX trains the MLP in a few ms a call)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    parser.add_argument("--write", action="store_true",
                        help="replace this backend's generated table in BENCHMARKS.md")
    parser.add_argument("--cell", help="workload,b,k,steps_per_execution: one contender's "
                        "samples/s per repeat, as JSON (benchmarks/compare.py)")
    parser.add_argument("--contender", default="accumulate", choices=CONTENDERS)
    args = parser.parse_args(argv)
    import keras

    backend = keras.backend.backend()
    if args.cell:
        workload, *numbers = args.cell.split(",")
        b, k, spe = (int(v) for v in numbers)
        rates = measure(workload, b, k, spe, [args.contender], args.repeats)
        print(json.dumps({"cell": args.cell, "contender": args.contender,
                          "rates": rates[args.contender]}))
        return
    scale = {name: float(value) for name, value in
             (item.split("=") for item in args.scale.split(",") if item)}
    started = time.perf_counter()
    rows = grid(args.workloads, args.batches, args.steps, args.repeats, scale, backend)
    if args.json:
        args.json.write_text(json.dumps({"backend": backend, "rows": rows}, indent=1))
    command = f"KERAS_BACKEND={backend} python benchmarks/equal.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    text = "\n".join([
        f"Command: `{command.strip()}` ({time.perf_counter() - started:.0f} s, "
        f"{args.repeats} interleaved repeats). " + environment(backend), "",
        table(rows), "", summary(rows, backend)])
    print(text)
    if args.write:
        write_section(text, backend)


if __name__ == "__main__":
    main()
