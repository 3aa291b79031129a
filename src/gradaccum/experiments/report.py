"""Tables, results files and the figure of a sweep."""

from __future__ import annotations

import csv
import json
import pathlib

from gradaccum.experiments.runner import Config, RunResult, summarize

COLUMNS = ("config", "k", "b", "updates", "micro-batches", "mean %", "std %", "wall s",
           "samples/s")


def config_summary(config: Config, results: list[RunResult], contrast: bool = False) -> dict:
    mean, std = summarize(results)
    wall = sum(r.wall_time for r in results)
    return {
        "label": config.label + (" (no accumulation)" if contrast else ""),
        "k": config.steps,
        "b": config.batch_size,
        "form": config.form,
        "updates": config.updates,
        "micro_batches": config.iterations,
        "mean": mean,
        "std": std,
        "wall_time": wall,
        "samples_per_second": config.iterations * config.batch_size * len(results) / wall,
        "contrast": contrast,
        "runs": [r.to_dict() for r in results],
    }


def table(rows: list[dict]) -> str:
    body = [
        (
            row["label"], str(row["k"]), str(row["b"]), str(row["updates"]),
            str(row["micro_batches"]), f"{row['mean']:.2f}", f"{row['std']:.3f}",
            f"{row['wall_time']:.1f}", f"{row['samples_per_second']:.0f}",
        )
        for row in rows
    ]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def write_results(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    keys = ["label", "k", "b", "form", "updates", "micro_batches", "mean", "std", "wall_time",
            "samples_per_second", "contrast"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# The colours of the site's figures (scripts/figures.py): an accumulated run is
# gradaccum's blue, the large batch without accumulation (k = 1) plain `fit` at k x b's
# purple, and the contrast (the micro-batch alone, no accumulation) plain `fit` at b's
# green.
ACCUMULATED, LARGE_BATCH, CONTRAST = "#0072B2", "#CC79A7", "#009E73"
MARKERS = "osD^vP*X"


def plot(path: pathlib.Path, rows: list[dict], title: str) -> None:
    """Accuracy mean +/- std per configuration (above), and test accuracy against
    updates (below), drawn at 7.5 in wide (a page's width) with text of 9 pt or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def colour(row: dict) -> str:
        if row["contrast"]:
            return CONTRAST
        return LARGE_BATCH if row.get("k", 2) == 1 else ACCUMULATED

    with plt.rc_context({"font.size": 10, "legend.fontsize": 9}):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7.5))
        labels = [row["label"].replace(" (no accumulation)", "\n(no accum.)")
                  for row in rows]
        top.bar(range(len(rows)), [row["mean"] for row in rows],
                yerr=[row["std"] for row in rows], color=[colour(r) for r in rows],
                capsize=4)
        top.set_xticks(range(len(rows)), labels)
        low = min(row["mean"] - row["std"] for row in rows)
        high = max(row["mean"] + row["std"] for row in rows)
        top.set_ylim(low - 1.0, high + 0.5)
        top.set_xlabel("k x b (micro-batches x samples)")
        top.set_ylabel("test accuracy (%)")
        top.set_title("final accuracy, mean +/- std over runs")
        for i, (row, label) in enumerate(zip(rows, labels)):
            curves = np.array([[acc for _, acc in run["curve"]] for run in row["runs"]])
            updates = [u for u, _ in row["runs"][0]["curve"]]
            bottom.plot(updates, curves.mean(axis=0), "--" if row["contrast"] else "-",
                        marker=MARKERS[i % len(MARKERS)], markersize=4,
                        color=colour(row), label=label.replace("\n", " "))
        bottom.set_xscale("log")
        bottom.set_xlabel("optimizer updates")
        bottom.set_ylabel("test accuracy (%)")
        bottom.set_title("test accuracy against updates (mean of runs)")
        bottom.legend()
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150)
        plt.close(fig)
