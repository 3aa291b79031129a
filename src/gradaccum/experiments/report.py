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


def plot(path: pathlib.Path, rows: list[dict], title: str) -> None:
    """Accuracy mean +/- std per configuration, and test accuracy against updates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [row["label"].replace(" (no accumulation)", "\n(no accum.)") for row in rows]
    colors = ["tab:gray" if row["contrast"] else "tab:blue" for row in rows]
    left.bar(range(len(rows)), [row["mean"] for row in rows],
             yerr=[row["std"] for row in rows], color=colors, capsize=4)
    left.set_xticks(range(len(rows)), labels)
    low = min(row["mean"] - row["std"] for row in rows)
    high = max(row["mean"] + row["std"] for row in rows)
    left.set_ylim(low - 1.0, high + 0.5)
    left.set_xlabel("k x b (micro-batches x samples)")
    left.set_ylabel("test accuracy (%)")
    left.set_title("final accuracy, mean +/- std over runs")
    for row, label in zip(rows, labels):
        curves = np.array([[acc for _, acc in run["curve"]] for run in row["runs"]])
        updates = [u for u, _ in row["runs"][0]["curve"]]
        style = "--" if row["contrast"] else "-"
        right.plot(updates, curves.mean(axis=0), style, marker="o", markersize=3,
                   label=label.replace("\n", " "))
    right.set_xscale("log")
    right.set_xlabel("optimizer updates")
    right.set_ylabel("test accuracy (%)")
    right.set_title("test accuracy against updates (mean of runs)")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
