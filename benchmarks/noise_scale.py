"""The gradient noise scale of `accumulate(model, steps=k, noise_scale=True)`: checked
against per-example gradients on MNIST (`truth`, JAX), and what it costs on the
realistic cell (`cost`, the Keras backend of the process).

    KERAS_BACKEND=jax python benchmarks/noise_scale.py truth            # 3-4 min, 2 cores
    KERAS_BACKEND=jax python benchmarks/noise_scale.py truth --write    # and BENCHMARKS.md
    KERAS_BACKEND=tensorflow python benchmarks/noise_scale.py cost --write  # 2-4 minutes
    KERAS_BACKEND=jax python benchmarks/noise_scale.py cost --write         # each
    KERAS_BACKEND=torch python benchmarks/noise_scale.py cost --write
    python benchmarks/noise_scale.py truth --quick     # smoke runs: small sizes, one
    python benchmarks/noise_scale.py cost --quick      # repeat (nothing to read in them)

`truth` (issue 68, deliverable 5): the seed experiment's MLP (784-128-10, ReLU: no
dropout nor batch normalization, so a micro-batch's gradient is the mean of its
samples' gradients) trains with Adam 1e-3 at batch 64 on the 60,000 training digits in
a seeded order. At each point (`--updates`, default after 30 updates and after one
epoch, 938) its weights are frozen and measured twice:

- the truth: per-example gradients (`jax.vmap` of the gradient of one digit's loss
  through the model's `stateless_call`) over N digits: G = their mean, tr(Sigma) =
  mean |g_i - G|^2 * N / (N - 1), |G|^2 unbiased = |G|^2 - tr(Sigma) / N,
  B = tr(Sigma) / |G|^2. Over a seeded subset of `--subset` digits (4096, "a few
  thousand") and over all 60,000 (`--no-pool` leaves that out: about a minute a point);
- gradaccum's estimate: `fit` of one epoch with `noise_scale=True` at learning rate 0
  (a copy of the weights compiled with SGD(0.0)) in windows of k x b over the same
  digits, read from `History`.

Both are measured on the same digits, so what they differ by is the estimator's own
noise, not the subset's. That noise is the windows' pairing: the epoch's estimate of
|G|^2 is made of the products g_i . g_j of digits that share a window but not a
micro-batch, the truth of all pairs (over random windows the two have the same
expectation, exactly). A trained network's per-example gradients are heavy-tailed (a
few misclassified digits carry squared norms 50x the mean), so one pass of 32 windows
over 4096 digits is noisy; the rows with `passes` > 1 train one epoch over that many
shuffled copies of the subset (every window of distinct digits), more windows over the
same digits (at another run's epoch point, B about 540, one pass of 8 x 16 landed within
20 % in 65 % of 240 shuffles, four passes in all: the windows' estimator replayed from
the digits' exact gradient products). The pool rows are one plain epoch over the 60,000.
B at one frozen point is itself a swinging figure: Adam's iterate makes it move tenfold
between neighbouring checkpoints (114 to 786 in 100 updates; past 2,000 at some), and
where B nears the digits' count neither a few thousand digits' truth nor their windows
pin it down (the unbiased |G|^2 is then a difference of two near numbers).

`cost` (issue 68, deliverable 2): the realistic cell `gpt2_lora` of
benchmarks/hub_workloads.py (KerasHub GPT-2 causal LM with LoRA, sequence 128), b = 8,
k = 4, `steps_per_execution` 1, Adam 1e-3: `accumulate(model, steps=4)` against
`accumulate(model, steps=4, noise_scale=True)`, both in one process, timed interleaved
(the order rotating) `--repeats` times on `--micro-batches` micro-batches an epoch,
after a warm-up epoch each (its traces). A figure is the median samples/s; the ratio is
noise_scale's time over plain's (wall, and the process's CPU time), the median of the
per-repeat ratios with their min-max. Goal: <= 1.02. Nothing is asserted. (The last
`noise_scale` shown is the last epoch's reading; on random tokens the LoRA gradient is
mostly noise, so a short epoch's reading is often NaN: no estimate of |G|^2 above 0.)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# The official MNIST IDX files beside the checkout, else the seed experiment's loader.
SHARED_MNIST = ROOT.parent / "shared" / "data" / "mnist"

BATCH = 64                  # the training's batch
SUBSET = 4096               # the truth's "few thousand" digits
# (k, b, passes, shuffles) of the rows over the subset: each shuffle one epoch.
SUBSET_ROWS = ((8, 16, 1, 5), (8, 16, 16, 1), (8, 64, 1, 5), (8, 64, 4, 1))
POOL_ROWS = ((8, 16, 1, 1), (4, 32, 1, 1))
QUICK = {"updates": (5, 40), "subset": 1024,
         "subset_rows": ((8, 16, 1, 2), (8, 16, 4, 1)), "pool": 0}
CELL = {"workload": "gpt2_lora", "b": 8, "k": 4}
CONTENDERS = ("plain", "noise_scale")


# --- truth -----------------------------------------------------------------------------

def mnist(source: str | None):
    from gradaccum.experiments import data

    if source is None:
        source = str(SHARED_MNIST) if SHARED_MNIST.is_dir() else "auto"
    return data.load_data(source)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def per_example_truth(model, x, y, chunk: int = 500) -> dict:
    """tr(Sigma), |G|^2 (unbiased) and B = tr(Sigma) / |G|^2 from the per-example
    gradients of `model`'s loss on each digit of `x` (the gradients' sum and their
    squared norms' sum, chunk by chunk, added in float64)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    loss_fn = loss()
    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def example_loss(weights, xi, yi):
        logits, _ = model.stateless_call(weights, fixed, xi[None], training=True)
        return loss_fn(yi[None], logits)

    @jax.jit
    def sums(weights, xc, yc):
        grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(weights, xc, yc)
        total = jnp.concatenate([jnp.sum(g, axis=0).ravel() for g in grads])
        return total, sum(jnp.sum(jnp.square(g)) for g in grads)

    total, squares = 0.0, 0.0
    for start in range(0, len(x), chunk):
        part, square = sums(trainable, x[start:start + chunk], y[start:start + chunk])
        total = total + np.asarray(part, np.float64)
        squares += float(square)
    n = len(x)
    mean = total / n
    trace = (squares - n * float(mean @ mean)) / (n - 1)
    gradient = float(mean @ mean) - trace / n
    return {"samples": n, "trace": trace, "gradient": gradient, "B": trace / gradient}


class Estimates:
    """gradaccum's noise scale at learning rate 0: one measuring model per (k, b),
    built once (a fit traces once), given the weights of each point."""

    def __init__(self):
        self.models = {}

    def model(self, k: int, b: int):
        if (k, b) not in self.models:
            import keras

            import gradaccum
            from gradaccum.experiments.models import build_model

            model = build_model("mlp", seed=0)
            model.compile(keras.optimizers.SGD(0.0), loss())
            self.models[k, b] = gradaccum.accumulate(model, steps=k, noise_scale=True)
        return self.models[k, b]

    def __call__(self, weights, x, y, k: int, b: int, passes: int, seed: int) -> float:
        """The epoch's `noise_scale` over `passes` shuffled copies of (x, y)."""
        import numpy as np

        rng = np.random.default_rng(seed)
        order = np.concatenate([rng.permutation(len(x)) for _ in range(passes)])
        model = self.model(k, b)
        model.set_weights(weights)
        history = model.fit(x[order], y[order], batch_size=b, epochs=1, shuffle=False,
                            verbose=0)
        return float(history.history["noise_scale"][-1])


def truth(updates, subset: int, subset_rows, pool_rows, source=None) -> dict:
    """The rows of the truth's table, one group per point of training."""
    import keras
    import numpy as np

    from gradaccum.experiments.models import build_model

    data = mnist(source)
    x, y = data.x_train, data.y_train
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    chosen = np.sort(rng.choice(len(x), subset, replace=False))
    trained = build_model("mlp", seed=0)
    trained.compile(keras.optimizers.Adam(1e-3), loss())
    estimates, points, done = Estimates(), [], 0
    for count in sorted(updates):
        if count > done:
            taken = order[done * BATCH:count * BATCH]
            trained.fit(x[taken], y[taken], batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0)
            done = count
        weights = trained.get_weights()
        groups = [("subset", x[chosen], y[chosen], subset_rows)]
        if pool_rows:
            groups.append(("pool", x, y, pool_rows))
        for name, xs, ys, rows in groups:
            started = time.perf_counter()
            reference = per_example_truth(trained, xs, ys)
            seconds = time.perf_counter() - started
            measured = []
            for k, b, passes, shuffles in rows:
                values = [estimates(weights, xs, ys, k, b, passes, seed)
                          for seed in range(shuffles)]
                measured.append({"k": k, "b": b, "passes": passes,
                                 "windows": passes * len(xs) // (k * b), "values": values})
            points.append({"updates": count, "group": name, "truth": reference,
                           "rows": measured})
            print(f"after {count} updates, {name}: truth B = {reference['B']:.1f} "
                  f"({seconds:.0f} s), estimates " + "; ".join(
                      f"{r['k']}x{r['b']}x{r['passes']}: "
                      + ", ".join(f"{v:.1f}" for v in r["values"]) for r in measured),
                  flush=True)
    # (the shared folder named as the checkout sees it, not by its absolute path)
    described = data.describe().removeprefix("data: ")
    return {"data": described.replace(str(SHARED_MNIST), "../shared/data/mnist"),
            "points": points}


def _spread(values, scale: float = 1.0, digits: int = 1) -> str:
    values = [v / scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
            f"{max(values):.{digits}f})")


def truth_table(result: dict) -> str:
    out = ["| after updates | digits | per-example tr(Sigma) | per-example abs(G)^2 | "
           "per-example B | gradaccum k x b | passes (windows) | shuffles | "
           "gradaccum B | gradaccum / per-example |",
           "| ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |"]
    for point in result["points"]:
        t = point["truth"]
        for row in point["rows"]:
            out.append(
                f"| {point['updates']} | {t['samples']} | {t['trace']:.4g} | "
                f"{t['gradient']:.4g} | {t['B']:.1f} | {row['k']} x {row['b']} | "
                f"{row['passes']} ({row['windows']}) | {len(row['values'])} | "
                f"{_spread(row['values'])} | {_spread(row['values'], t['B'], 3)} |")
    return "\n".join(out)


def truth_summary(result: dict) -> str:
    """Each row's estimates within 20 % of the truth, counted."""
    lines = []
    for point in result["points"]:
        for row in point["rows"]:
            within = sum(abs(v / point["truth"]["B"] - 1) <= 0.2 for v in row["values"])
            lines.append(f"- after {point['updates']} updates, {point['group']} "
                         f"({point['truth']['samples']} digits), {row['k']} x {row['b']}, "
                         f"{row['passes']} pass(es): within 20 % in {within} of "
                         f"{len(row['values'])}.")
    return "\n".join(lines)


# --- cost ------------------------------------------------------------------------------

def compiled(name: str, k: int):
    """The cell's model: `accumulate(steps=k)`, with the noise scale for `noise_scale`
    (Adam 1e-3, the workload's loss, steps_per_execution 1; the same seeded weights)."""
    import keras
    import workloads

    import gradaccum

    model = workloads.build(CELL["workload"])
    model = gradaccum.accumulate(model, steps=k, noise_scale=name == "noise_scale")
    model.compile(keras.optimizers.Adam(1e-3), workloads.loss(), steps_per_execution=1)
    return model


def cost(micro_batches: int, repeats: int) -> dict:
    """Samples/s per contender and repeat, in wall and in CPU time, and the noise
    scale's last reading."""
    import workloads

    b, k = CELL["b"], CELL["k"]
    micro = max(k, micro_batches // k * k)
    arrays = workloads.fit_data(CELL["workload"], micro * b)
    models = {}
    for name in CONTENDERS:
        models[name] = compiled(name, k)
        # The warm-up: an epoch of the same arrays (its traces, and whatever else a
        # first epoch of this length costs).
        models[name].fit(**arrays, batch_size=b, epochs=1, shuffle=False, verbose=0)
    wall = {name: [] for name in CONTENDERS}
    cpu = {name: [] for name in CONTENDERS}
    reading = None
    for r in range(repeats):
        for name in CONTENDERS[r % 2:] + CONTENDERS[:r % 2]:
            started, process = time.perf_counter(), time.process_time()
            history = models[name].fit(**arrays, batch_size=b, epochs=1, shuffle=False,
                                       verbose=0)
            wall[name].append(micro * b / (time.perf_counter() - started))
            cpu[name].append(micro * b / (time.process_time() - process))
            if name == "noise_scale":
                reading = history.history["noise_scale"][-1]
        print(f"repeat {r + 1}: " + ", ".join(
            f"{n} {wall[n][-1]:.1f} samples/s" for n in CONTENDERS), flush=True)
    return {"micro_batches": micro, "repeats": repeats, "wall": wall, "cpu": cpu,
            "noise_scale": reading}


def time_ratio(rates: dict) -> tuple:
    """(median, min, max) of the per-repeat time ratios noise_scale / plain."""
    pairs = [p / n for p, n in zip(rates["plain"], rates["noise_scale"])]
    return statistics.median(pairs), min(pairs), max(pairs)


def cost_table(result: dict) -> str:
    def shown(r):
        return f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"

    wall, cpu = result["wall"], result["cpu"]
    return "\n".join([
        "| cell | accumulate (samples/s) | accumulate, noise_scale=True (samples/s) | "
        "time: noise_scale / plain | CPU time: noise_scale / plain | last noise_scale |",
        "| --- | ---: | ---: | --- | --- | ---: |",
        f"| {CELL['workload']}, b = {CELL['b']}, k = {CELL['k']}, "
        f"{result['micro_batches']} micro-batches | "
        f"{statistics.median(wall['plain']):.2f} | "
        f"{statistics.median(wall['noise_scale']):.2f} | {shown(time_ratio(wall))} | "
        f"{shown(time_ratio(cpu))} | {result['noise_scale']:.4g} |"])


# --- the command -----------------------------------------------------------------------

def markers(part: str, backend: str):
    label = f"{part}, {backend}"
    return (f"<!-- generated by benchmarks/noise_scale.py ({label}): begin -->",
            f"<!-- generated by benchmarks/noise_scale.py ({label}): end -->")


def write_section(text: str, part: str, backend: str) -> None:
    from equal import write_between

    write_between(*markers(part, backend), text)


def _ints(text: str):
    return tuple(int(v) for v in text.split(","))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("truth", "cost"))
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and one repeat: a smoke run")
    parser.add_argument("--updates", type=_ints,
                        help="truth: Adam updates at batch 64 before each point "
                        "(default: 30,938)")
    parser.add_argument("--subset", type=int, help=f"truth: digits (default {SUBSET})")
    parser.add_argument("--no-pool", action="store_true",
                        help="truth: leave out the rows over the 60,000 digits")
    parser.add_argument("--data", help="truth: the seed experiment's --data (default: "
                        "../shared/data/mnist beside the checkout, else auto)")
    parser.add_argument("--micro-batches", type=int,
                        help="cost: micro-batches an epoch (default 32; --quick 8)")
    parser.add_argument("--repeats", type=int,
                        help="cost: interleaved repeats (default 9; --quick 1)")
    parser.add_argument("--write", action="store_true",
                        help="replace the part's generated section in BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.part == "truth":
        os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    from equal import environment

    backend = keras.backend.backend()
    started = time.perf_counter()
    if args.part == "truth":
        if backend != "jax":
            raise SystemExit("`truth` takes per-example gradients with jax.vmap: run it "
                             f"with KERAS_BACKEND=jax. Received: backend {backend!r}")
        quick = QUICK if args.quick else {}
        pool = quick.get("pool", 1) and not args.no_pool
        result = truth(args.updates or quick.get("updates", (30, 938)),
                       args.subset or quick.get("subset", SUBSET),
                       quick.get("subset_rows", SUBSET_ROWS), POOL_ROWS if pool else (),
                       args.data)
        body = [f"Data: {result['data']}.", "", truth_table(result), "",
                truth_summary(result)]
    else:
        result = cost(args.micro_batches or (8 if args.quick else 32),
                      args.repeats or (1 if args.quick else 9))
        body = [cost_table(result), "",
                f"- Goal: time noise_scale / plain <= 1.02 (backend {backend})."]
    command = f"KERAS_BACKEND={backend} python benchmarks/noise_scale.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    text = "\n".join([f"Command: `{command.strip()}` "
                      f"({time.perf_counter() - started:.0f} s). " + environment(backend),
                      "", *body])
    print(text)
    if args.write:
        write_section(text, args.part, backend)


if __name__ == "__main__":
    main()
