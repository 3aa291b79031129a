"""Two versions of gradaccum side by side: a commit against another, or the working
tree against a commit, timed interleaved in one run, so that a change sees a slowdown
before it lands.

    python benchmarks/compare.py HEAD                  # the working tree against HEAD
    python benchmarks/compare.py main~3 main           # two commits
    python benchmarks/compare.py HEAD --cells mlp,8,4,4 mlp,8,1,1 --rounds 5
    KERAS_BACKEND=jax python benchmarks/compare.py HEAD

Each version's `src/` is exported from git into a temporary folder (the working tree
is used as it is); each measurement is a fresh process of `benchmarks/equal.py --cell`
(this checkout's harness, the version's gradaccum first on PYTHONPATH) that traces,
then times `--repeats` epochs. Rounds alternate which version goes first. Printed per
cell: each version's samples/s (median, min-max over the rounds, each round the median
of its repeats) and the ratio new / old per round (median, min-max): below 1.00 is a
slowdown, and a spread that straddles 1.00 is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CELLS = ("mlp,8,4,1", "mlp,8,4,4", "mlp,8,1,1", "transformer,8,4,4")


def export(ref: str, into: pathlib.Path) -> pathlib.Path:
    """`ref`'s src/ in a folder of its own (git archive: no worktree to clean up)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def measure(src: pathlib.Path, cell: str, contender: str, repeats: int) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(src)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run(
        [sys.executable, str(HERE / "equal.py"), "--cell", cell, "--contender", contender,
         "--repeats", str(repeats)],
        capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{cell} with {src} failed:\n{out.stderr[-2000:]}")
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["rates"])


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the commit to compare against")
    parser.add_argument("new", nargs="?", help="a commit (default: the working tree)")
    parser.add_argument("--cells", nargs="+", default=list(CELLS),
                        help="workload,b,k,steps_per_execution (default: %(default)s)")
    parser.add_argument("--contender", default="accumulate",
                        choices=("accumulate", "builtin", "plain"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per process")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gradaccum-compare-") as tmp:
        old = export(args.old, pathlib.Path(tmp, "old"))
        new = export(args.new, pathlib.Path(tmp, "new")) if args.new else ROOT / "src"
        label = args.new or "working tree"
        backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        print(f"{args.contender}: {label} (new) against {args.old} (old), "
              f"{args.rounds} rounds x {args.repeats} repeats, KERAS_BACKEND={backend}")
        print("| cell (workload,b,k,spe) | old samples/s | new samples/s | new / old |")
        print("| --- | --- | --- | --- |")
        for cell in args.cells:
            rates = {"old": [], "new": []}
            for r in range(args.rounds):
                order = (("old", old), ("new", new))
                for side, src in (order if r % 2 == 0 else order[::-1]):
                    rates[side].append(measure(src, cell, args.contender, args.repeats))
            ratios = [n / o for n, o in zip(rates["new"], rates["old"])]

            def show(values):
                return (f"{statistics.median(values):.0f} "
                        f"({min(values):.0f}-{max(values):.0f})")

            print(f"| {cell} | {show(rates['old'])} | {show(rates['new'])} | "
                  f"{spread(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
