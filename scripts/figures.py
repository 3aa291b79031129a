"""The site's performance figures, drawn from the benchmarks' JSON records
(`benchmarks/results.json`, written by `benchmarks/run.py --write`, and
`benchmarks/gpu-h200.jsonl`, the lines `benchmarks/gpu_suite.sh` wrote on an NVIDIA
H200).

    python scripts/figures.py [OUT_DIR]     (default: docs/figures)

Writes `throughput.png` (per workload and micro-batch size b: samples per second of
gradaccum's `accumulate` and of Keras's `gradient_accumulation_steps`, each over plain
`fit` at b, against the window length k) and `memory.png` (peak memory against the
effective batch: plain `fit` at that batch, and gradaccum at b = 32) and `gpu.png`
(the GPU cell per backend and precision: samples per second of Keras's built-in and
of `accumulate` over plain `fit`, and peak device memory) and `backends.png` (every
cell of each backend's CPU grid, from the tables `benchmarks/equal.py --write` wrote
into BENCHMARKS.md). The mkdocs
hook (`docs/hooks.py`) runs it before each build.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results.json"
GPU = ROOT / "benchmarks" / "gpu-h200.jsonl"
RECORD = ROOT / "BENCHMARKS.md"
BACKENDS = ("tensorflow", "jax", "torch")


def throughput(cells, out: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    workloads = sorted({c["workload"] for c in cells})
    sizes = sorted({c["b"] for c in cells})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.8),
                             sharey=True)
    for ax, workload in zip(axes, workloads):
        for b, color in zip(sizes, ("tab:blue", "tab:orange", "tab:green")):
            rows = sorted((c for c in cells if c["workload"] == workload and c["b"] == b
                           and c["k"] > 1), key=lambda c: c["k"])
            ks = [c["k"] for c in rows]
            ours = [c["rates"]["gradaccum_fit"] / c["rates"]["plain_b"] for c in rows]
            keras_ = [c["rates"]["keras_builtin"] / c["rates"]["plain_b"] for c in rows]
            ax.plot(ks, ours, "o-", color=color, label=f"gradaccum, b={b}")
            ax.plot(ks, keras_, "x--", color=color, alpha=0.6, label=f"Keras built-in, b={b}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(workload)
        ax.set_xlabel("window length k (micro-batches per update)")
    axes[0].set_ylabel("samples/s over plain fit at b")
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(sizes) * 2,
               frameon=False)
    fig.suptitle("Throughput against plain fit at the micro-batch size (TensorFlow, CPU)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


def memory(rows, out: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for mode, style in (("plain", "o-"), ("gradaccum", "s-")):
        points = sorted((r["effective_batch"], r["peak_rss_mib"]) for r in rows
                        if r["mode"] == mode)
        label = "plain fit at B" if mode == "plain" else "gradaccum, b = 32, k = B / 32"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("effective batch B (samples per update)")
    ax.set_ylabel("peak memory (MiB, process RSS)")
    ax.legend(fontsize=8)
    ax.set_title("Peak memory against the effective batch (TensorFlow, CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)


def gpu(rows, out: pathlib.Path) -> None:
    """The GPU cell: per run of the source the record was measured at (a run of an
    older source, `src/gradaccum at <commit>`, kept for comparison, is left out),
    each contender's samples per second over plain fit's (the median of per-repeat
    ratios, min-max as bars), and the peak device memory of plain fit at b,
    accumulate and plain fit at k x b."""
    import matplotlib.pyplot as plt

    configs = {r["run"]: r for r in rows if r["kind"] == "config"}
    current = {run for run, c in configs.items()
               if c["environment"]["gradaccum"] == "src/gradaccum"}
    cells = []
    for run in sorted(current, key=lambda r: (configs[r]["backend"], configs[r]["precision"])):
        ratios = {r["ratio"]: r for r in rows if r["kind"] == "ratio" and r["run"] == run}
        if configs[run]["mode"] == "throughput" and "accumulate/plain" in ratios:
            cells.append((configs[run], ratios))
    memory_rows = [r for r in rows if r["kind"] == "memory" and r["run"] in current]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6),
                                      gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for offset, (name, color) in enumerate((("builtin/plain", "tab:gray"),
                                            ("accumulate/plain", "tab:blue"))):
        xs, ys, low, high = [], [], [], []
        for i, (_, ratios) in enumerate(cells):
            if name in ratios:
                r = ratios[name]
                xs.append(i + (offset - 0.5) * width)
                ys.append(r["median"])
                low.append(r["median"] - r["min"])
                high.append(r["max"] - r["median"])
        label = "Keras built-in" if name.startswith("builtin") else "gradaccum accumulate"
        left.bar(xs, ys, width, yerr=[low, high], color=color, label=label, capsize=3)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(range(len(cells)))
    left.set_xticklabels([f"{c['backend']}, {c['precision']}" for c, _ in cells], fontsize=8)
    left.set_ylim(0.8, 1.1)
    left.set_ylabel("samples/s over plain fit at b\n(the axis starts at 0.8)")
    left.legend(fontsize=8, loc="lower right")
    left.set_title("GPT-2 124M, b = 8, k = 4, sequence 512", fontsize=9)
    names = {"plain": "plain fit\nb = 8", "accumulate": "accumulate\nb = 8, k = 4",
             "plain_kb": "plain fit\nb = 32"}
    right.bar([names[r["contender"]] for r in memory_rows],
              [r["device_peak_mib"] for r in memory_rows],
              color=["tab:gray", "tab:blue", "tab:orange"][:len(memory_rows)])
    right.set_ylabel("peak device memory (MiB)")
    right.tick_params(axis="x", labelsize=8)
    right.set_title("Peak memory (JAX, float32)", fontsize=9)
    device = next(iter(configs.values()))["environment"]["device"]["name"].split(" ", 1)[1]
    fig.suptitle(f"On the GPU ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "gpu.png", dpi=110)
    plt.close(fig)


def grid_tables(text: str) -> dict:
    """The cells of each backend's grid as `benchmarks/equal.py --write` wrote them
    into BENCHMARKS.md (its generated block per backend): per cell the workload, b, k,
    steps_per_execution and the ratios `accumulate / plain fit` and
    `accumulate / built-in` as (median, low, high), None where the cell has none."""
    def ratio(field: str):
        found = re.match(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", field.strip())
        return tuple(float(v) for v in found.groups()) if found else None

    grids = {}
    for backend in BACKENDS:
        begin = f"<!-- generated by benchmarks/equal.py ({backend}): begin -->"
        end = f"<!-- generated by benchmarks/equal.py ({backend}): end -->"
        if begin not in text:
            continue
        block = text[text.index(begin):text.index(end)]
        rows = [line.strip().strip("|").split("|") for line in block.splitlines()
                if line.startswith("| ") and not line.startswith(("| workload", "| ---"))]
        header = next(line for line in block.splitlines() if line.startswith("| workload"))
        names = [h.strip() for h in header.strip().strip("|").split("|")]
        cells = []
        for row in rows:
            cell = dict(zip(names, (f.strip() for f in row)))
            cells.append({"workload": cell["workload"], "b": int(cell["b"]),
                          "k": int(cell["k"]), "spe": int(cell["steps_per_execution"]),
                          "plain": ratio(cell["accumulate / plain fit"]),
                          "builtin": ratio(cell["accumulate / built-in"])})
        grids[backend] = cells
    return grids


def backends(grids: dict, out: pathlib.Path) -> None:
    """Per backend, every cell of its CPU grid: accumulate over plain fit at b and
    over Keras's built-in (median of the interleaved repeats' ratios, their range as
    a bar), the cells grouped by workload."""
    import matplotlib.pyplot as plt

    values = [v for cells in grids.values() for c in cells for key in ("plain", "builtin")
              if (v := c[key]) is not None]
    bottom, top = min(v[1] for v in values), max(v[2] for v in values)
    fig, axes = plt.subplots(len(grids), 1, figsize=(11, 2.9 * len(grids)), sharey=True)
    axes = list(axes) if len(grids) > 1 else [axes]
    for ax, (backend, cells) in zip(axes, grids.items()):
        labels = []
        for i, cell in enumerate(cells):
            labels.append(f"{cell['workload']} {cell['b']}x{cell['k']}"
                          + (f" s{cell['spe']}" if cell["spe"] > 1 else ""))
            for key, color, shift in (("plain", "tab:blue", -0.15),
                                      ("builtin", "tab:gray", 0.15)):
                value = cell[key]
                if value is None:
                    continue
                median, low, high = value
                ax.errorbar(i + shift, median, yerr=[[median - low], [high - median]],
                            fmt="o", color=color, markersize=4, capsize=2, linewidth=0.8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
        ax.set_xlim(-0.7, len(cells) - 0.3)
        ax.set_yscale("log", base=2)
        ax.set_ylim(bottom / 1.15, top * 1.15)
        ax.set_ylabel("samples/s ratio")
        ax.set_title(f"{backend}, CPU: accumulate over plain fit at b (blue) and over "
                     "Keras's built-in (grey)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "backends.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else ROOT / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    record = json.loads(RESULTS.read_text())
    throughput(record["throughput"], out)
    memory(record["memory"], out)
    gpu([json.loads(line) for line in GPU.read_text().splitlines() if line.strip()], out)
    backends(grid_tables(RECORD.read_text()), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
