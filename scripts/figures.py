"""The site's performance figures, drawn from the benchmarks' JSON record
(`benchmarks/results.json`, written by `benchmarks/run.py --write`).

    python scripts/figures.py [OUT_DIR]     (default: docs/figures)

Writes `throughput.png` (per workload and micro-batch size b: samples per second of
gradaccum's `accumulate` and of Keras's `gradient_accumulation_steps`, each over plain
`fit` at b, against the window length k) and `memory.png` (peak memory against the
effective batch: plain `fit` at that batch, and gradaccum at b = 32). The mkdocs
hook (`docs/hooks.py`) runs it before each build.
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results.json"


def throughput(cells, out: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    workloads = sorted({c["workload"] for c in cells})
    sizes = sorted({c["b"] for c in cells})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4),
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
    axes[-1].legend(fontsize=7)
    fig.suptitle("Throughput against plain fit at the micro-batch size (TensorFlow, CPU)",
                 fontsize=10)
    fig.tight_layout()
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


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else ROOT / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    record = json.loads(RESULTS.read_text())
    throughput(record["throughput"], out)
    memory(record["memory"], out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
