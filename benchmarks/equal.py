"""gradaccum's own cost: `accumulate` against Keras's built-in accumulation and plain
`fit`, at equal settings (the same model, data, micro-batch b, window k and
`steps_per_execution`), on the Keras backend of the process.

    KERAS_BACKEND=tensorflow python benchmarks/equal.py           # the grid, printed
    KERAS_BACKEND=jax python benchmarks/equal.py --write          # and BENCHMARKS.md's table
    KERAS_BACKEND=torch python benchmarks/equal.py --write        # (steps_per_execution 1)
    python benchmarks/equal.py --workloads mlp --batches 8 --steps 4   # part of the grid
    python benchmarks/equal.py --cell mlp,8,4,4 --contender accumulate # one figure (JSON)

    # The realistic grid: KerasHub tasks (benchmarks/hub_workloads.py), b = 4 and 8,
    # k = 4 and 16, steps_per_execution 1; 15-20 minutes a backend on 2 cores.
    KERAS_BACKEND=tensorflow python benchmarks/equal.py --grid realistic --write
    KERAS_BACKEND=jax python benchmarks/equal.py --grid realistic --spe both  # and at k
    KERAS_BACKEND=torch python benchmarks/equal.py --grid realistic --workloads gpt2_lora \
        --batches 4 --steps 4 --repeats 1 --scale gpt2_lora=0.25             # a smoke run
    # Their peak memory at k = 16, each contender in fresh processes (5-10 minutes).
    KERAS_BACKEND=tensorflow python benchmarks/equal.py --memory --write
    python benchmarks/equal_memory.py bert,8,16 accumulate  # one process's peak (JSON)

Contenders, each trains `n` micro-batches of b with Adam 1e-3 through `fit`:

- `plain`: plain `fit` at b (one update per micro-batch);
- `builtin`: Keras's `gradient_accumulation_steps=k` (k > 1);
- `accumulate`: `gradaccum.accumulate(model, steps=k)` (at k = 1 plain training through
  gradaccum: its sparse gradients summed, its non-finite screen);
- `unscreened` (k = 1): the same with `nonfinite="apply"`, Keras's behaviour on a
  non-finite gradient: what the screen costs.

The tiny grid (`--grid tiny`, the default: benchmarks/workloads.py's MLP, CNN and
Transformer, millisecond steps) runs every cell at `steps_per_execution` 1 and k
(micro-batches per compiled call); the realistic grid at 1 (`--spe` picks: a
micro-batch there takes 0.1-0.4 s, beside which a call's fixed cost is small), on 32
micro-batches an epoch. The contenders of a cell live in one process and are timed
interleaved, `--repeats` times, after a warm-up epoch that traces. A figure is the
median samples/s; a ratio is the median of the per-repeat ratios (neighbours in time,
so a drift of the machine cancels), with their min and max as the spread. Nothing is
asserted: the figures are read against the targets in BENCHMARKS.md
(`benchmarks/compare.py` runs the `--cell` mode of this script on two commits).

`--memory` measures each contender's peak memory in fresh processes, once each
(`--repeats` for more), for each realistic workload and b at k = 16, and prints the
peaks and their ratios to plain fit's (benchmarks/equal_memory.py says how).
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

from cells import count, make  # noqa: E402

# What an epoch (a repeat) trains: samples, or for the KerasHub tasks micro-batches
# at any b (32: 2 windows of k = 16; a micro-batch of 8 takes 0.1-0.4 s on 2 cores).
SAMPLES = {"mlp": 8192, "cnn": 2048, "transformer": 2048}
MICRO_BATCHES = {"gpt2_lora": 32, "gpt2_full": 32, "bert": 32}
GRIDS = {"tiny": (("mlp", "cnn", "transformer"), (8, 32, 128), (1, 4, 16)),
         "realistic": (("gpt2_lora", "gpt2_full", "bert"), (4, 8), (4, 16))}
MEMORY_GRID = (GRIDS["realistic"][0], GRIDS["realistic"][1], (16,))  # --memory
CONTENDERS = ("plain", "builtin", "accumulate", "unscreened")


def contenders_for(k: int) -> list[str]:
    return ["plain", "builtin", "accumulate"] if k > 1 else ["plain", "accumulate",
                                                             "unscreened"]


def measure(workload: str, b: int, k: int, spe: int, names, repeats: int,
            scale: float = 1.0) -> dict:
    """Samples/s of each contender, per repeat (interleaved, rotating the order), on
    `scale` times the workload's samples (micro-batches)."""
    import workloads

    unit = k * spe // _gcd(k, spe)
    wanted = (MICRO_BATCHES[workload] * scale if workload in MICRO_BATCHES
              else SAMPLES[workload] * scale // b)
    micro = max(unit, int(wanted) // unit * unit)
    arrays = workloads.fit_data(workload, micro * b)
    # The warm-up traces; a KerasHub task's micro-batches are long, so one window
    # (both branches of the update) does, the tiny workloads take two.
    warm = min(micro, (1 if workload in workloads.HUB_WORKLOADS else 2) * unit) * b
    trainers = {}
    for name in names:
        train = make(name, workload, b, k, spe)
        train(workloads.head(arrays, warm))
        trainers[name] = train
    rates = {name: [] for name in names}
    for r in range(repeats):
        order = list(names[r % len(names):]) + list(names[: r % len(names)])
        for name in order:
            start, cpu = time.perf_counter(), time.process_time()
            trainers[name](arrays)
            rates[name].append(micro * b / (time.perf_counter() - start))
            CPU_RATES.setdefault(name, []).append(micro * b / (time.process_time() - cpu))
    return rates


# Samples per CPU-second of the last `measure`, per contender and repeat: the work a
# contender does, whatever share of the cores the machine gave it (on the project's
# 2-core machine a multi-threaded epoch sometimes runs on one core, its wall time
# doubled at the same CPU time).
CPU_RATES: dict = {}


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


def cells(workloads_, batches, steps, backend="tensorflow", spe="both"):
    """(workload, b, k, steps_per_execution) of the grid; `spe` is "1", "k" or "both"."""
    for workload in workloads_:
        for b in batches:
            for k in steps:
                # (Keras's torch trainer runs one batch per call.)
                chosen = {"1": {1}, "k": {k}, "both": {1, k}}[spe]
                for spe_ in [1] if backend == "torch" else sorted(chosen):
                    yield workload, b, k, spe_


def grid(workloads_, batches, steps, repeats: int, scale: dict,
         backend: str = "tensorflow", spe: str = "both") -> list[dict]:
    rows = []
    for workload, b, k, spe_ in cells(workloads_, batches, steps, backend, spe):
        started = time.perf_counter()
        CPU_RATES.clear()
        rates = measure(workload, b, k, spe_, contenders_for(k), repeats,
                        scale.get(workload, 1.0))
        rows.append({"workload": workload, "b": b, "k": k, "spe": spe_, "rates": rates,
                     "cpu_rates": dict(CPU_RATES)})
        print(f"{workload} b={b} k={k} spe={spe_}: " + ", ".join(
            f"{n} {statistics.median(v):.0f}" for n, v in rates.items())
            + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def _show(r) -> str:
    return "-" if r is None else f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def table(rows: list[dict]) -> str:
    """The grid's table; the nonfinite='apply' column only where a row has it (k = 1)."""
    unscreened = any("unscreened" in row["rates"] for row in rows)
    cpu = all("cpu_rates" in row for row in rows)
    out = ["| workload | b | k | steps_per_execution | plain fit | built-in | accumulate | "
           "accumulate / built-in | accumulate / plain fit |"
           + (" nonfinite='apply' / plain fit |" if unscreened else "")
           + (" CPU time: accumulate / built-in | CPU time: accumulate / plain fit |"
              if cpu else ""),
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
           + (" --- |" if unscreened else "") + (" --- | --- |" if cpu else "")]
    for row in rows:
        rates = row["rates"]

        def cell(name, rates=rates):
            return f"{statistics.median(rates[name]):.0f}" if name in rates else "-"

        out.append(
            f"| {row['workload']} | {row['b']} | {row['k']} | {row['spe']} | "
            f"{cell('plain')} | {cell('builtin')} | {cell('accumulate')} | "
            f"{_show(ratio(rates, 'accumulate', 'builtin'))} | "
            f"{_show(ratio(rates, 'accumulate', 'plain'))} |"
            + (f" {_show(ratio(rates, 'unscreened', 'plain'))} |" if unscreened else "")
            + (f" {_show(ratio(row['cpu_rates'], 'accumulate', 'builtin'))} |"
               f" {_show(ratio(row['cpu_rates'], 'accumulate', 'plain'))} |" if cpu else ""))
    return "\n".join(out)


def summary(rows: list[dict], backend: str, realistic: bool = False) -> str:
    """The cells against the targets: issue 31's for the tiny grid, for the realistic
    one >= 1.0 against the built-in and >= 0.97 against plain fit in every cell (a
    micro-batch costs the same in all three)."""
    goal_builtin = 1.2 if backend == "jax" and not realistic else 1.0
    goal_plain = 0.9 if backend == "jax" and not realistic else 0.97
    vs_builtin = [ratio(r["rates"], "accumulate", "builtin")[0] for r in rows if r["k"] > 1]
    if backend == "jax" or realistic:
        vs_plain = [ratio(r["rates"], "accumulate", "plain")[0] for r in rows]
        plain_what = "every cell (plain fit at b)"
    else:
        vs_plain = [ratio(r["rates"], "accumulate", "plain")[0] for r in rows if r["k"] == 1]
        plain_what = "k = 1"
    lines = []
    if vs_builtin:
        lines.append(f"- accumulate / built-in (k > 1): {count(vs_builtin, goal_builtin)}")
    if vs_plain:
        lines.append(f"- accumulate / plain fit ({plain_what}): "
                     f"{count(vs_plain, goal_plain)}")
    unscreened = [ratio(r["rates"], "unscreened", "plain")[0] for r in rows
                  if "unscreened" in r["rates"]]
    if unscreened:
        lines.append(
            f"- accumulate with nonfinite='apply' / plain fit (k = 1, no screen): median "
            f"{statistics.median(unscreened):.2f}, range {min(unscreened):.2f}-"
            f"{max(unscreened):.2f}.")
    if all("cpu_rates" in r for r in rows):
        cpu_builtin = [ratio(r["cpu_rates"], "accumulate", "builtin")[0] for r in rows
                       if r["k"] > 1]
        cpu_plain = [ratio(r["cpu_rates"], "accumulate", "plain")[0] for r in rows]
        if cpu_builtin:
            lines.append(f"- In CPU time, accumulate / built-in (k > 1): "
                         f"{count(cpu_builtin, goal_builtin)}")
        lines.append(f"- In CPU time, accumulate / plain fit (every cell): "
                     f"{count(cpu_plain, goal_plain)}")
    if realistic:
        lines.append("- Peak memory at k = 16 (goal <= 1.05x plain fit): the next table "
                     "(`--memory`).")
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


def markers(backend: str, section: str = ""):
    """The marks around a generated section: the tiny grid's, `realistic` or
    `realistic memory`."""
    label = f"{section}, {backend}" if section else backend
    return (f"<!-- generated by benchmarks/equal.py ({label}): begin -->",
            f"<!-- generated by benchmarks/equal.py ({label}): end -->")


def write_section(text: str, backend: str, section: str = "") -> None:
    write_between(*markers(backend, section), text)


def write_between(begin: str, end: str, text: str) -> None:
    """BENCHMARKS.md with `text` between the marks `begin` and `end`."""
    path = ROOT / "BENCHMARKS.md"
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
    parser.add_argument("--grid", choices=tuple(GRIDS), default="tiny",
                        help="the workloads, b and k unless given (default: %(default)s)")
    parser.add_argument("--workloads", type=lambda s: s.split(","))
    parser.add_argument("--batches", type=_ints)
    parser.add_argument("--steps", type=_ints)
    parser.add_argument("--spe", choices=("1", "k", "both"),
                        help="steps_per_execution 1, k or both (TensorFlow and JAX; "
                        "default: both on the tiny grid, 1 on the realistic one)")
    parser.add_argument("--repeats", type=int,
                        help="interleaved repeats (default: 3; 1 with --memory)")
    parser.add_argument("--scale", default="", help="more samples for some workloads, "
                        "e.g. mlp=8 (JAX trains the MLP in a few ms a call)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    parser.add_argument("--write", action="store_true",
                        help="replace this backend's generated table in BENCHMARKS.md")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory of plain fit, the built-in and accumulate, each "
                        "in fresh processes (default: the realistic workloads, k = 16)")
    parser.add_argument("--cell", help="workload,b,k,steps_per_execution: one contender's "
                        "samples/s per repeat, as JSON (benchmarks/compare.py)")
    parser.add_argument("--contender", default="accumulate", choices=CONTENDERS)
    args = parser.parse_args(argv)
    import keras

    backend = keras.backend.backend()
    if args.cell:
        workload, *numbers = args.cell.split(",")
        b, k, spe = (int(v) for v in numbers)
        rates = measure(workload, b, k, spe, [args.contender], args.repeats or 3)
        print(json.dumps({"cell": args.cell, "contender": args.contender,
                          "rates": rates[args.contender]}))
        return
    defaults = MEMORY_GRID if args.memory else GRIDS[args.grid]
    workloads_ = args.workloads or defaults[0]
    batches = args.batches or defaults[1]
    steps = args.steps or defaults[2]
    realistic = args.memory or args.grid == "realistic"
    started = time.perf_counter()
    if args.memory:
        import equal_memory

        repeats = args.repeats or 1
        rows = equal_memory.compare(workloads_, batches, steps, repeats)
        body = [equal_memory.table(rows), "", equal_memory.summary(rows)]
        section = "realistic memory"
    else:
        repeats = args.repeats or 3
        scale = {name: float(value) for name, value in
                 (item.split("=") for item in args.scale.split(",") if item)}
        rows = grid(workloads_, batches, steps, repeats, scale, backend,
                    args.spe or ("1" if realistic else "both"))
        body = [table(rows), "", summary(rows, backend, realistic)]
        section = "realistic" if realistic else ""
    if args.json:
        args.json.write_text(json.dumps({"backend": backend, "rows": rows}, indent=1))
    command = f"KERAS_BACKEND={backend} python benchmarks/equal.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    text = "\n".join([
        f"Command: `{command.strip()}` ({time.perf_counter() - started:.0f} s, "
        f"{repeats} {'fresh processes per contender' if args.memory else 'interleaved repeats'}"
        f"). " + environment(backend), "", *body])
    print(text)
    if args.write:
        write_section(text, backend, section)


if __name__ == "__main__":
    main()
