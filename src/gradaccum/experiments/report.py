"""Tables, results files and the figure of a sweep."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import statistics
import textwrap

from gradaccum.experiments.runner import Config, RunResult, summarize

# What a configuration whose k follows the noise scale adds to its label.
FOLLOWS = " (follows the noise scale)"
COLUMNS = ("config", "k", "b", "updates", "samples", "micro-batches", "mean %", "std %",
           "wall s", "samples/s")


def label(config: Config, contrast: bool = False) -> str:
    """A configuration's name in the tables: `5x20`; `1x5 (no accumulation)` for the
    contrast; `5..50x20 (follows the noise scale)` where k follows it."""
    return (config.label + (" (no accumulation)" if contrast else "")
            + (FOLLOWS if config.follows else ""))


def config_summary(config: Config, results: list[RunResult], contrast: bool = False) -> dict:
    """One row of the sweep: the configuration, its runs' accuracy (mean and
    population std), time, and where it was measured, the noise scale at each
    evaluation point (the median over runs of the readings, None where no run has
    one); the updates are the runs' mean where k follows the noise scale."""
    mean, std = summarize(results)
    wall = sum(r.wall_time for r in results)
    updates = config.updates
    if updates is None:
        updates = round(statistics.fmean(r.curve[-1][0] for r in results))
    points = len(results[0].curve)
    return {
        "label": label(config, contrast),
        "k": config.steps,
        "max_steps": config.max_steps,
        "b": config.batch_size,
        "form": config.form,
        "follows": config.follows,
        "updates": updates,
        "samples": config.samples,
        "micro_batches": config.iterations,
        "mean": mean,
        "std": std,
        "wall_time": wall,
        "samples_per_second": config.iterations * config.batch_size * len(results) / wall,
        "contrast": contrast,
        # The samples each point had trained on, and the noise scale read there.
        "points_samples": [config.samples * (i + 1) // points for i in range(points)],
        "noise_scale": [_median([r.noise_scale[i] for r in results])
                        for i in range(len(results[0].noise_scale))],
        "runs": [r.to_dict() for r in results],
    }


def _median(values) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def noise_agreement(rows: list[dict]) -> dict | None:
    """How closely the fixed splits' readings of the noise scale agree: run by run
    (the same seed trains the same model in every split) and point by point, the
    largest reading over the smallest, minus 1. Returns the splits compared and
    the median and the largest of those gaps (None with fewer than two splits)."""
    fixed = [row for row in rows if row["noise_scale"] and not row["follows"]]
    if len(fixed) < 2:
        return None
    gaps = []
    for run in range(len(fixed[0]["runs"])):
        readings = [row["runs"][run]["noise_scale"] for row in fixed]
        for point in zip(*readings):
            if all(v is not None and v > 0 for v in point):
                gaps.append(max(point) / min(point) - 1.0)
    if not gaps:
        return None
    return {"configs": [row["label"] for row in fixed], "median": statistics.median(gaps),
            "largest": max(gaps), "compared": len(gaps)}


def _steps_text(row: dict) -> str:
    return f"{row['k']}..{row['max_steps']}" if row.get("max_steps") else str(row["k"])


def _columns(header, body) -> str:
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(header)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(header, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    body = [
        (
            row["label"], _steps_text(row), str(row["b"]), str(row["updates"]),
            str(row["samples"]), str(row["micro_batches"]), f"{row['mean']:.2f}",
            f"{row['std']:.3f}", f"{row['wall_time']:.1f}",
            f"{row['samples_per_second']:.0f}",
        )
        for row in rows
    ]
    return _columns(COLUMNS, body)


def noise_table(rows: list[dict]) -> str:
    """The noise scale over training: a row per configuration, a column per
    evaluation point (headed by the samples trained on, where the rows share them),
    "n/a" where it is not measured (plain Keras; k = 1, whose windows of one
    micro-batch measure nothing) and "nan" where no run had an estimate."""
    points = max(len(row["points_samples"]) for row in rows)
    shared = {tuple(row["points_samples"]) for row in rows}
    if len(shared) == 1:
        header = [_thousands(s) for s in next(iter(shared))]
    else:
        header = [f"point {i + 1}" for i in range(points)]
    body = []
    for row in rows:
        readings = row["noise_scale"] or ["n/a"] * points
        body.append((row["label"], *(_reading(v) for v in readings),
                     *([""] * (points - len(readings)))))
    return _columns(("samples trained on", *header), body)


def _thousands(samples: int) -> str:
    return f"{samples / 1000:g}k" if samples >= 1000 else str(samples)


def _reading(value) -> str:
    if value == "n/a":
        return value
    return "nan" if value is None else f"{value:.0f}"


def write_results(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    """A line per configuration; `noise_scale_i`: its noise scale at the i-th
    evaluation point (empty where not measured or NaN)."""
    keys = ["label", "k", "max_steps", "b", "form", "updates", "samples", "micro_batches",
            "mean", "std", "wall_time", "samples_per_second", "contrast"]
    points = max(len(row["noise_scale"]) for row in rows)
    noise = [f"noise_scale_{i + 1}" for i in range(points)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + noise, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            readings = dict(zip(noise, row["noise_scale"]))
            writer.writerow(row | {name: "" if v is None else v
                                   for name, v in readings.items()})


# The colours of the site's figures (scripts/figures.py): an accumulated run is
# gradaccum's blue, the large batch without accumulation (k = 1) plain `fit` at k x b's
# purple, and the contrast (the micro-batch alone, no accumulation) plain `fit` at b's
# green.
ACCUMULATED, LARGE_BATCH, CONTRAST = "#0072B2", "#CC79A7", "#009E73"
MARKERS = "osD^vP*X"


def plot(path: pathlib.Path, rows: list[dict], title: str) -> None:
    """Accuracy mean +/- std per configuration (top), test accuracy against updates
    (middle) and the noise scale against updates (bottom, `noise_panel`), drawn at
    7.5 in wide (a page's width) with text of 9 pt or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 10, "legend.fontsize": 9}):
        fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7.5, 10.5))
        labels = [_short(row["label"]).replace(" (", "\n(") for row in rows]
        ticks = [label.replace("follows ", "follows\n") for label in labels]
        top.bar(range(len(rows)), [row["mean"] for row in rows],
                yerr=[row["std"] for row in rows], color=[_colour(r) for r in rows],
                capsize=4)
        top.set_xticks(range(len(rows)), ticks)
        low = min(row["mean"] - row["std"] for row in rows)
        high = max(row["mean"] + row["std"] for row in rows)
        top.set_ylim(low - 1.0, high + 0.5)
        top.set_xlabel("k x b (micro-batches x samples)")
        top.set_ylabel("test accuracy (%)")
        top.set_title("final accuracy, mean +/- std over runs")
        for i, (row, name) in enumerate(zip(rows, labels)):
            accuracy = [statistics.fmean(run["curve"][j][1] for run in row["runs"])
                        for j in range(len(row["runs"][0]["curve"]))]
            middle.plot(_updates(row), accuracy, "--" if row["contrast"] else "-",
                        marker=MARKERS[i % len(MARKERS)], markersize=4,
                        color=_colour(row), label=name.replace("\n", " "))
        middle.set_xscale("log")
        middle.set_xlabel("optimizer updates")
        middle.set_ylabel("test accuracy (%)")
        middle.set_title("test accuracy against updates (mean of runs)")
        middle.legend()
        noise_panel(bottom, rows)
        bottom.legend(fontsize=9, loc="upper right")
        # (A long data line, its source and cache, wrapped to the figure's width.)
        fig.suptitle("\n".join(textwrap.fill(line, 75) for line in title.splitlines()),
                     fontsize=11)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150)
        plt.close(fig)


def noise_panel(ax, rows: list[dict], name: str = "") -> None:
    """The noise scale against updates on `ax`: each configuration that read it
    (the median over runs at each evaluation point, drawn at the point's updates,
    the runs' mean), the batch k x b of a configuration whose k follows it, and a
    line at the fixed configurations' samples per update. `name` opens each legend
    entry."""
    for i, row in enumerate(rows):
        if not row["noise_scale"]:
            continue
        updates = _updates(row)
        readings = [math.nan if v is None else v for v in row["noise_scale"]]
        ax.plot(updates, readings, "-", marker=MARKERS[i % len(MARKERS)], markersize=4,
                color=ACCUMULATED, label=f"{name}{_short(row['label'])}")
        if row["follows"]:
            batch = [row["b"] * statistics.fmean(run["steps"][j] for run in row["runs"])
                     for j in range(len(updates))]
            # Each point's k held over the updates since the point before.
            ax.step(updates, batch, ":", where="pre", color=ACCUMULATED,
                    label=f"{name}{_short(row['label'])}: its batch k x b")
    fixed = {row["k"] * row["b"] for row in rows
             if not row["follows"] and not row["contrast"]}
    for batch in sorted(fixed):
        ax.axhline(batch, color="black", linewidth=1, gid="equal")
        ax.text(0.01, batch * 1.08, f"{batch} samples per update (the fixed splits)",
                transform=ax.get_yaxis_transform(), fontsize=9, va="bottom")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 6)  # room above the lines for the legend
    for axis in (ax.xaxis, ax.yaxis):
        # Ticks at 1, 2 and 5 of each power of ten, written out (100, not 10^2).
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("optimizer updates")
    ax.set_ylabel("noise scale B_simple (samples)")
    ax.set_title("the gradient noise scale against updates (median of runs)")


def _colour(row: dict) -> str:
    if row["contrast"]:
        return CONTRAST
    return LARGE_BATCH if row.get("k", 2) == 1 else ACCUMULATED


def _short(label: str) -> str:
    return label.replace(" (no accumulation)", " (no accum.)").replace(
        FOLLOWS, " (follows B_simple)")


def _updates(row: dict) -> list[float]:
    """The updates at each evaluation point, the runs' mean (the same in every run
    but where k follows the noise scale)."""
    return [statistics.fmean(run["curve"][j][0] for run in row["runs"])
            for j in range(len(row["runs"][0]["curve"]))]
