"""Split mode (issue 15): memory and throughput of `micro_batch_size` against the
alternatives, measured side by side.

    python benchmarks/split.py [--batch 2048] [--micro 32] [--repeats 5] [--write]

Memory: peak resident set of one fit, each point in a fresh process
(benchmarks/memory.py): plain fit at b, split mode at B with micro-batches of b,
plain fit at B, and `steps=B/b` at b. Throughput (samples/s, interleaved repeats on
the same data): `accumulate(micro_batch_size=b)` at `fit(batch_size=B)` against
`accumulate(steps=B/b)` at `fit(batch_size=b)`, the median of per-repeat ratios.
With --write the tables replace the split section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
BEGIN, END = "<!-- split:begin -->", "<!-- split:end -->"


def memory_point(workload, mode, batch, steps=1, micro=None):
    cmd = [sys.executable, str(HERE / "memory.py"), "--workload", workload, "--mode", mode,
           "--batch", str(batch), "--steps", str(steps)]
    if micro:
        cmd += ["--micro-batch-size", str(micro)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"mode": mode, "batch": batch, "error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(workload, b, k, repeats, updates):
    import contenders
    import workloads

    names = ["gradaccum_split", "gradaccum_accumulate"]
    x, y = workloads.data(workload, updates * k * b)
    trainers = {}
    for name in names:
        train = contenders.make(name, workload, b, k)
        train(x[: k * b], y[: k * b])  # traces
        trainers[name] = train
    rates = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % 2:] + names[: r % 2]:
            start = time.perf_counter()
            trainers[name](x, y)
            rates[name].append(len(x) / (time.perf_counter() - start))
        print(f"repeat {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items()),
              flush=True)
    return rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=4, help="updates per timed run")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    big, b = args.batch, args.micro
    k = big // b
    started = time.perf_counter()
    points = []
    for mode, batch, steps, micro in (
        ("plain", b, 1, None), ("split", big, 1, b), ("plain", big, 1, None),
        ("gradaccum", b, k, None),
    ):
        points.append(memory_point(args.workload, mode, batch, steps, micro))
        print(json.dumps(points[-1]), flush=True)
    rates = throughput(args.workload, b, k, args.repeats, args.updates)
    ratios = [s / a for s, a in zip(rates["gradaccum_split"], rates["gradaccum_accumulate"])]
    total = time.perf_counter() - started

    def peak(mode, batch):
        return next(p["peak_rss_mib"] for p in points if p["mode"] == mode and p["batch"] == batch)

    base = peak("plain", b)
    labels = {
        ("plain", b): f"plain fit, batch {b}",
        ("split", big): f"split: fit(batch_size={big}), micro_batch_size={b}",
        ("plain", big): f"plain fit, batch {big}",
        ("gradaccum", b): f"steps={k}, fit(batch_size={b})",
    }
    lines = [
        f"Command: `python benchmarks/split.py --batch {big} --micro {b} --repeats "
        f"{args.repeats} --updates {args.updates}` ({total:.0f} s), workload "
        f"`{args.workload}`.",
        "",
        "| run | peak RSS (MiB) | / plain fit at b |",
        "| --- | ---: | ---: |",
    ]
    for p in points:
        lines.append(f"| {labels[(p['mode'], p['batch'])]} | {p['peak_rss_mib']:.0f} | "
                     f"{p['peak_rss_mib'] / base:.2f} |")
    split_rates, steps_rates = rates["gradaccum_split"], rates["gradaccum_accumulate"]
    lines += [
        "",
        f"Throughput, {args.updates} updates of {big} samples per run, {args.repeats} "
        "interleaved repeats (samples/s):",
        "",
        "| contender | median | repeats |",
        "| --- | ---: | --- |",
        f"| split (micro_batch_size={b}, batch {big}) | {statistics.median(split_rates):.0f} | "
        + ", ".join(f"{v:.0f}" for v in split_rates) + " |",
        f"| steps={k} (batch {b}) | {statistics.median(steps_rates):.0f} | "
        + ", ".join(f"{v:.0f}" for v in steps_rates) + " |",
        "",
        f"Split / steps, per repeat: {', '.join(f'{r:.2f}' for r in ratios)}; median "
        f"**{statistics.median(ratios):.2f}**.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        path = HERE.parent / "BENCHMARKS.md"
        head, _, rest = path.read_text().partition(BEGIN)
        if not rest:
            raise SystemExit(f"BENCHMARKS.md has no {BEGIN} marker")
        _, _, tail = rest.partition(END)
        path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()
