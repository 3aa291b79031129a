"""The site's performance figures, drawn from the benchmarks' records
(`benchmarks/results.json`, written by `benchmarks/run.py --write`;
`benchmarks/gpu-h200.jsonl`, the lines `benchmarks/gpu_suite.sh` wrote on an NVIDIA
H200; and the tables `benchmarks/equal.py --write` wrote into BENCHMARKS.md).

    python scripts/figures.py [OUT_DIR]     (default: docs/figures)

Writes five PNG files:

- `throughput.png`: per workload, micro-batch size b and window length k, the samples
  per second of gradaccum (its `wrap`, which those rows measured) and of Keras's
  `gradient_accumulation_steps`, each over plain `fit` at b (TensorFlow, CPU);
- `memory.png`: peak memory against the effective batch B, plain `fit` at B and
  gradaccum at b = 32;
- `gpu.png`: the GPU cell per backend and precision (samples per second of Keras's
  built-in and of `accumulate` over plain `fit`) and its peak device memory;
- `backends.png`: every cell of each backend's CPU grid, `accumulate` over plain `fit`
  and over Keras's built-in;
- `noise-scale.png`: the gradient noise scale of the seed experiment against updates
  (`docs/experiment/results.json`, the default `gradaccum sweep` on JAX), drawn by
  the sweep's own panel (`gradaccum.experiments.report.noise_panel`).

Every figure is drawn at the width of the page's content column (`WIDTH` inches) with
no text under `SMALLEST` points, so the page shows it at its size; each contender has
one colour in every figure (`COLOURS`); every figure with more than one series has a
legend (tests/test_figures.py checks the three). The mkdocs hook (`docs/hooks.py`)
runs this before each build.
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
EXPERIMENT = ROOT / "docs" / "experiment" / "results.json"
BACKENDS = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}

# The page's content column is about 670-740 px wide (the material theme with both
# sidebars); at 96 px per inch a figure 7 inches wide is shown at about its size, so
# its points are the reader's points.
WIDTH = 7.0
SMALLEST = 9
DPI = 200  # sharp on a high-density screen; the page scales the image to the column

# One colour per contender, the same in every figure (Okabe and Ito's palette, which
# readers with a colour vision deficiency tell apart). A legend names the contender as
# its key reads. optax's MultiSteps is in no figure yet; its colour is kept for it.
COLOURS = {
    "gradaccum": "#0072B2",         # blue
    "Keras's built-in": "#E69F00",  # orange
    "plain fit at b": "#009E73",    # bluish green
    "plain fit at k×b": "#CC79A7",  # reddish purple
    "optax MultiSteps": "#D55E00",  # vermillion
}
EQUAL = "#000000"  # the line at a ratio of 1 where it means "as fast", not a contender

STYLE = {
    "font.size": SMALLEST,
    "axes.titlesize": SMALLEST + 1,
    "axes.labelsize": SMALLEST,
    "xtick.labelsize": SMALLEST,
    "ytick.labelsize": SMALLEST,
    "legend.fontsize": SMALLEST,
    "figure.titlesize": SMALLEST + 2,
    "figure.facecolor": "white",  # a white card on the dark theme too
    "savefig.facecolor": "white",
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def _figure(height: float, **subplots):
    """A figure of the page's width and `height` inches, with its axes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(WIDTH, height), layout="constrained")
    axes = figure.subplots(**subplots)
    for ax in figure.axes:  # ticks are made when drawn: their size set here holds then
        ax.tick_params(labelsize=SMALLEST)
    return figure, axes


def _ratio_axis(ax, axis: str = "y", ticks=(0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4)) -> None:
    """A log axis of ratios labelled 0.5x, 1x, 2x."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    target = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log", base=2)
    target.set_major_locator(FixedLocator(list(ticks)))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    target.set_minor_locator(NullLocator())


def throughput(cells):
    """Per workload, for each micro-batch size b and window length k > 1, samples per
    second of `accumulate` and of Keras's built-in over plain `fit` at b."""
    workloads = sorted({c["workload"] for c in cells})
    sizes = sorted({c["b"] for c in cells})
    lengths = sorted({c["k"] for c in cells if c["k"] > 1})
    figure, axes = _figure(3.4, ncols=len(workloads), sharey=True)
    figure.suptitle("Speed over plain fit at the micro-batch size b (TensorFlow, CPU)")
    contenders = (("gradaccum", "gradaccum_fit", "o"), ("Keras's built-in", "keras_builtin", "s"))
    for ax, workload in zip(axes, workloads):
        for name, key, marker in contenders:
            for k, line in zip(lengths, ("--", "-")):
                rows = {c["b"]: c for c in cells if c["workload"] == workload and c["k"] == k}
                ys = [rows[b]["rates"][key] / rows[b]["rates"]["plain_b"] for b in sizes]
                full = k == lengths[-1]
                ax.plot(sizes, ys, line, marker=marker, color=COLOURS[name],
                        markerfacecolor=COLOURS[name] if full else "white",
                        label=f"{name}, k = {k}")
        ax.axhline(1.0, color=COLOURS["plain fit at b"], linewidth=1.2,
                   label="plain fit at b")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
        ax.set_title(workload)
        ax.set_xlabel("micro-batch size b")
        ax.grid(axis="y", linewidth=0.4, alpha=0.5)
    _ratio_axis(axes[0])
    axes[0].set_ylabel("samples/s over plain fit at b")
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
                  ncols=3, frameon=False)
    return figure


def memory(rows):
    """Peak memory against the effective batch B: plain `fit` at B, and gradaccum at
    b = 32 with k = B / 32."""
    figure, ax = _figure(3.0)
    for name, mode, marker, label in (
            ("plain fit at k×b", "plain", "s", "plain fit at k×b: the whole batch B at once"),
            ("gradaccum", "gradaccum", "o", "gradaccum: b = 32, k = B / 32")):
        points = sorted((r["effective_batch"], r["peak_rss_mib"]) for r in rows
                        if r["mode"] == mode)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker,
                color=COLOURS[name], label=label)
    batches = sorted({r["effective_batch"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("effective batch B (samples per update)")
    ax.set_ylabel("peak memory (MiB, process RSS)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", linewidth=0.4, alpha=0.5)
    ax.legend(loc="upper left", frameon=False)
    ax.set_title("Peak memory against the effective batch (TensorFlow, CPU)")
    return figure


def gpu(rows):
    """The GPU cell: per run of the source the record was measured at (a run of an
    older source, `src/gradaccum at <commit>`, kept for comparison, is left out),
    each contender's samples per second over plain fit's (the median of per-repeat
    ratios, min-max as bars), and the peak device memory of plain fit at b,
    accumulate and plain fit at k x b."""
    from matplotlib.patches import Patch

    configs = {r["run"]: r for r in rows if r["kind"] == "config"}
    current = {run for run, c in configs.items()
               if c["environment"]["gradaccum"] == "src/gradaccum"}
    cells = []
    for run in sorted(current, key=lambda r: (configs[r]["backend"], configs[r]["precision"])):
        ratios = {r["ratio"]: r for r in rows if r["kind"] == "ratio" and r["run"] == run}
        if configs[run]["mode"] == "throughput" and "accumulate/plain" in ratios:
            cells.append((configs[run], ratios))
    memory_rows = [r for r in rows if r["kind"] == "memory" and r["run"] in current]
    b, k, sequence = (cells[0][0][key] for key in ("micro_batch", "k", "sequence"))
    figure, (left, right) = _figure(3.6, ncols=2, width_ratios=[3, 2])
    width = 0.38
    for offset, (name, ratio) in enumerate((("Keras's built-in", "builtin/plain"),
                                            ("gradaccum", "accumulate/plain"))):
        xs, ys, low, high = [], [], [], []
        for i, (_, ratios) in enumerate(cells):
            if ratio in ratios:
                r = ratios[ratio]
                xs.append(i + (offset - 0.5) * width)
                ys.append(r["median"])
                low.append(r["median"] - r["min"])
                high.append(r["max"] - r["median"])
        left.bar(xs, ys, width, yerr=[low, high], color=COLOURS[name], label=name,
                 capsize=3)
    left.axhline(1.0, color=COLOURS["plain fit at b"], linewidth=1.5,
                 label="plain fit at b")
    left.set_xticks(range(len(cells)),
                    [f"{BACKENDS[c['backend']]}\n{c['precision']}" for c, _ in cells])
    left.set_ylim(0.8, 1.1)
    left.set_ylabel("samples/s over plain fit at b\n(the axis starts at 0.8)")
    left.set_title("Speed")
    contenders = {"plain": ("plain fit at b", f"plain fit\nb = {b}"),
                  "accumulate": ("gradaccum", f"gradaccum\nb = {b}, k = {k}"),
                  "plain_kb": ("plain fit at k×b", f"plain fit\nb = {k * b}")}
    right.bar([contenders[r["contender"]][1] for r in memory_rows],
              [r["device_peak_mib"] / 1024 for r in memory_rows],
              color=[COLOURS[contenders[r["contender"]][0]] for r in memory_rows])
    right.set_ylabel("peak device memory (GiB)")
    right.set_title(f"Memory ({BACKENDS[memory_rows[0]['backend']]}, "
                    f"{memory_rows[0]['precision']})")
    handles = left.get_legend_handles_labels()
    handles[0].append(Patch(color=COLOURS["plain fit at k×b"]))
    handles[1].append("plain fit at k×b")
    device = next(iter(configs.values()))["environment"]["device"]["name"].split(" ", 1)[1]
    figure.suptitle(f"GPT-2 124M on one {device}: b = {b}, k = {k}, sequence {sequence}")
    figure.legend(*handles, loc="outside lower center", ncols=4, frameon=False)
    return figure


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


def backends(grids: dict):
    """Every cell of each backend's CPU grid, one row per cell: gradaccum's samples
    per second over plain fit's at b and over Keras's built-in's (the median of the
    interleaved repeats' ratios, their range as a bar); a column per backend, a row
    of panels per workload."""
    workloads = list(dict.fromkeys(c["workload"] for cells in grids.values() for c in cells))
    settings = sorted({(c["b"], c["k"], c["spe"]) for cells in grids.values()
                       for c in cells})
    figure, axes = _figure(2.7 * len(workloads) + 0.6, nrows=len(workloads),
                           ncols=len(grids), sharex=True, sharey=True, squeeze=False)
    values = [v for cells in grids.values() for c in cells for key in ("plain", "builtin")
              if (v := c[key]) is not None]
    series = (("plain", "plain fit at b", "o", -0.17), ("builtin", "Keras's built-in", "s", 0.17))
    for row, workload in enumerate(workloads):
        for column, (backend, cells) in enumerate(grids.items()):
            ax = axes[row][column]
            found = {(c["b"], c["k"], c["spe"]): c for c in cells if c["workload"] == workload}
            for key, name, marker, shift in series:
                points = [(y, found[s][key]) for y, s in enumerate(settings)
                          if s in found and found[s][key] is not None]
                if not points:
                    continue
                medians = [v[0] for _, v in points]
                ax.errorbar(medians, [y + shift for y, _ in points],
                            xerr=[[m - v[1] for m, (_, v) in zip(medians, points)],
                                  [v[2] - m for m, (_, v) in zip(medians, points)]],
                            fmt=marker, color=COLOURS[name], markersize=3.5,
                            linewidth=0.9, label=f"over {name}")
            ax.axvline(1.0, color=EQUAL, linewidth=0.8, gid="equal")
            if not found:
                ax.text(1.0, len(settings) / 2, "not measured", ha="center", va="center")
            ax.grid(axis="x", linewidth=0.4, alpha=0.5)
            if row == 0:
                ax.set_title(BACKENDS[backend])
        axes[row][0].set_ylabel(workload)
    ax = axes[0][0]
    _ratio_axis(ax, "x", ticks=(0.5, 1, 2))
    ax.set_xlim(min(v[1] for v in values) / 1.1, max(v[2] for v in values) * 1.1)
    ax.set_yticks(range(len(settings)),
                  [f"{b} × {k}" + (f", s = {s}" if s > 1 else "") for b, k, s in settings])
    ax.set_ylim(len(settings) - 0.5, -0.5)
    axes[-1][len(grids) // 2].set_xlabel("gradaccum's samples/s over the other's "
                                         "(right of 1x: gradaccum is faster)")
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.suptitle("Each backend on a CPU, per cell b × k (s = steps_per_execution)")
    figure.legend(handles, labels, loc="outside lower center", ncols=2, frameon=False,
                  title="gradaccum's samples/s", title_fontsize=SMALLEST)
    return figure


def noise_scale(sweep: dict):
    """The seed experiment's gradient noise scale against updates: each split's, and
    the run whose k follows it with its batch, beside the splits' 100 samples per
    update (the guide "Choosing k")."""
    from gradaccum.experiments import report

    figure, ax = _figure(3.8)
    report.noise_panel(ax, sweep["configs"], name="gradaccum ")
    ax.set_title("")
    figure.suptitle("The gradient noise scale of the seed experiment (MNIST, MLP, Adam; "
                    f"median of {sweep['settings']['runs']} runs)")
    ax.grid(linewidth=0.4, alpha=0.5)
    ax.legend(loc="upper right", frameon=False)
    return figure


def draw() -> dict:
    """Every figure, drawn from the records: name -> matplotlib Figure."""
    import matplotlib

    with matplotlib.rc_context(STYLE):
        record = json.loads(RESULTS.read_text())
        lines = [json.loads(line) for line in GPU.read_text().splitlines() if line.strip()]
        return {"throughput": throughput(record["throughput"]),
                "memory": memory(record["memory"]),
                "gpu": gpu(lines),
                "backends": backends(grid_tables(RECORD.read_text())),
                "noise-scale": noise_scale(json.loads(EXPERIMENT.read_text()))}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else ROOT / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    with matplotlib.rc_context(STYLE):
        for name, figure in draw().items():
            figure.savefig(out / f"{name}.png", dpi=DPI)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
