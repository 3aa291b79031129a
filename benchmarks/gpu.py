"""The GPU cell (issue 54): a GPT-2-small-shaped model on one accelerator, trained by
plain `fit`, Keras's built-in accumulation and `gradaccum.accumulate`, on JAX or
PyTorch (the process's KERAS_BACKEND).

    KERAS_BACKEND=jax python benchmarks/gpu.py --out gpu.jsonl        # the cell, float32
    KERAS_BACKEND=torch python benchmarks/gpu.py --precision mixed_bfloat16 --out gpu.jsonl
    KERAS_BACKEND=jax python benchmarks/gpu.py --memory --out gpu.jsonl  # peak memory
    KERAS_BACKEND=jax python benchmarks/gpu.py --tiny                  # seconds, on a CPU

The model: KerasHub's `GPT2Backbone` built from a config in code (vocabulary 50257,
12 layers, 12 heads, hidden 768, intermediate 3072, 1024 positions; nothing
downloaded), its logits through the tied token embedding (`reverse=True`) in a plain
functional `keras.Model` with the inputs `token_ids` and `padding_mask`; sparse
categorical cross-entropy from the logits, the targets' padding mask as
`sample_weight`, Adam 1e-4. Data: random token ids (NumPy, seeded) of sequence length
512, a third of the rows padded (id 0) after 50-100% of the sequence, as
GPT2CausalLMPreprocessor would hand `fit` (x the first 512 tokens, y the next ones).

Contenders, each on the same data, from the same initial weights:

- `plain`: plain `fit` at the micro-batch b (one update per micro-batch);
- `builtin`: Keras's `Adam(gradient_accumulation_steps=k)`, at b;
- `accumulate`: `gradaccum.accumulate(model, steps=k)`, at b (its default
  `steps_per_execution`: k, a window per compiled call);
- `plain_kb`: plain `fit` at k * b (the large batch a window stands for; the same
  samples in micro_batches / k batches);
- `accumulate_one_step` (JAX): `accumulate` with one compiled step for every
  micro-batch, the update inside its `lax.cond` (gradaccum's step before the two
  steps chosen on the host, which an accelerator runs by default: the pair measures
  what they gain).

All contenders live in one process: each is built and compiled once and trains a
warm-up epoch (which traces and compiles), then an epoch of `--micro-batches`
micro-batches per repeat, the repeats interleaved and the order rotated each repeat.
An epoch is timed with `time.perf_counter` around `fit(..., epochs=1, verbose=0,
shuffle=False)` and a synchronization with the device after it. A figure is
samples/s; a ratio is the median of the per-repeat ratios (neighbours in time), with
its min and max.

`--memory` runs each contender in a fresh process (`--only NAME --memory-probe`):
it trains the warm-up epoch, then one epoch (on PyTorch the peak is reset between
them), and reports the backend's peak of device memory: JAX's `peak_bytes_in_use`
(the process's: JAX cannot reset it), torch's `max_memory_allocated`; on a CPU the
process's `ru_maxrss` instead, labelled as such.

`--out PATH` appends each result as one JSON line as soon as it is measured (a killed
run keeps what it measured); a readable table is printed at the end. gradaccum is
imported from `$GRADACCUM_SRC` when that is set, else from this checkout's src/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, os.environ.get("GRADACCUM_SRC") or str(ROOT / "src"))

CONTENDERS = ("plain", "builtin", "accumulate", "plain_kb", "accumulate_one_step")
BACKENDS = ("jax", "torch")
# The cell's sizes, and --tiny's (a few seconds on a CPU).
FULL = {"vocabulary": 50257, "layers": 12, "heads": 12, "hidden": 768,
        "intermediate": 3072, "positions": 1024, "sequence": 512, "batch": 8,
        "steps": 4, "micro_batches": 16, "repeats": 3}
TINY = {"vocabulary": 256, "layers": 2, "heads": 2, "hidden": 32, "intermediate": 64,
        "positions": 16, "sequence": 16, "batch": 2, "steps": 2, "micro_batches": 4,
        "repeats": 1}
SIZES = tuple(FULL)
LEARNING_RATE = 1e-4
SEED = 0


def check_backend() -> str:
    """The process's KERAS_BACKEND, refused unless it is JAX or PyTorch."""
    backend = os.environ.get("KERAS_BACKEND", "")
    if backend not in BACKENDS:
        raise SystemExit(
            f"benchmarks/gpu.py runs on KERAS_BACKEND=jax or KERAS_BACKEND=torch; this "
            f"process has KERAS_BACKEND={backend or '(unset)'!s}. Set it, e.g. "
            f"`KERAS_BACKEND=jax python benchmarks/gpu.py`.")
    import keras

    if keras.backend.backend() != backend:  # pragma: no cover (keras.json overriding)
        raise SystemExit(f"Keras runs on {keras.backend.backend()}, not {backend}.")
    return backend


def device(backend: str) -> dict:
    """The device the backend trains on: its kind and name."""
    if backend == "jax":
        import jax

        d = jax.devices()[0]
        return {"platform": d.platform, "name": f"{d.platform}:{d.id} {d.device_kind}",
                "count": jax.device_count()}
    import torch

    if torch.cuda.is_available():
        return {"platform": "gpu", "name": f"cuda:0 {torch.cuda.get_device_name(0)}",
                "count": torch.cuda.device_count()}
    return {"platform": "cpu", "name": f"cpu ({torch.get_num_threads()} threads)",
            "count": 1}


def environment(backend: str) -> dict:
    import keras
    import keras_hub

    if backend == "jax":
        import jax

        version = f"JAX {jax.__version__}"
    else:
        import torch

        version = f"PyTorch {torch.__version__}"
    import gradaccum

    return {"python": platform.python_version(), "keras": keras.__version__,
            "keras_hub": keras_hub.__version__, "framework": version,
            "gradaccum": str(pathlib.Path(gradaccum.__file__).parent),
            "cpus": os.cpu_count(), "device": device(backend)}


def build(cfg: dict):
    """The GPT-2-shaped model: token_ids and padding_mask -> GPT2Backbone -> logits
    through the tied token embedding. Its weights are drawn from Keras's seed."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=cfg["vocabulary"], num_layers=cfg["layers"],
        num_heads=cfg["heads"], hidden_dim=cfg["hidden"],
        intermediate_dim=cfg["intermediate"],
        max_sequence_length=max(cfg["positions"], cfg["sequence"]))
    inputs = {"token_ids": keras.Input((cfg["sequence"],), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((cfg["sequence"],), dtype="int32",
                                          name="padding_mask")}
    hidden = backbone(inputs)
    logits = backbone.token_embedding(hidden, reverse=True)
    return keras.Model(inputs, logits, name="gpt2_lm")


def compiled(name: str, cfg: dict, weights=None):
    """A model compiled as contender `name`; `weights`, when given, set first."""
    import keras

    model = build(cfg)
    if weights is not None:
        model.set_weights(weights)
    k = cfg["steps"]
    if name == "builtin":
        optimizer = keras.optimizers.Adam(LEARNING_RATE, gradient_accumulation_steps=k)
    elif name in ("plain", "accumulate", "plain_kb", "accumulate_one_step"):
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
    else:
        raise ValueError(f"unknown contender {name!r}")
    if name in ("accumulate", "accumulate_one_step"):
        import gradaccum

        model = gradaccum.accumulate(model, steps=k)  # steps_per_execution: its default
        if name == "accumulate_one_step":
            # (JAX) the step before issue 54's two steps, for the pair's ratio.
            model._gradaccum_accumulation.phases_wanted = False
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch_of(name: str, cfg: dict) -> int:
    return cfg["batch"] * cfg["steps"] if name == "plain_kb" else cfg["batch"]


def data(cfg: dict, n: int, seed: int = SEED) -> dict:
    """`fit`'s x, y and sample_weight for n sequences (benchmarks/hub_workloads.py's
    padding: a third of the rows padded, id 0, after 50-100% of the sequence)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    length = cfg["sequence"]
    ids = rng.integers(1, cfg["vocabulary"], (n, length + 1))
    lengths = np.where(rng.random(n) < 1 / 3, rng.integers(length // 2, length + 1, n),
                       length + 1)
    mask = np.arange(length + 1) < lengths[:, None]
    ids = (ids * mask).astype("int32")
    return {"x": {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1].astype("int32")},
            "y": ids[:, 1:], "sample_weight": mask[:, 1:].astype("float32")}


def synchronize(model, backend: str) -> None:
    """Waits until the device has finished the model's work."""
    if backend == "jax":
        import jax

        jax.block_until_ready([v.value for v in model.trainable_variables])
    else:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def train_epoch(model, arrays: dict, batch: int, backend: str) -> float:
    """Seconds of one epoch of `fit` on `arrays` at `batch`, synchronized. Python's
    garbage collector runs before it and not during it (as `timeit` does), so that a
    full collection among the objects of four models and their traces does not land
    in whichever contender's epoch it happens to fall."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        model.fit(**arrays, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        synchronize(model, backend)
        return time.perf_counter() - start
    finally:
        gc.enable()


class Results:
    """Appends each result as a JSON line to `path` (if any) as it is measured."""

    def __init__(self, path, common: dict):
        self.path, self.common, self.rows = path, common, []

    def add(self, row: dict) -> dict:
        row = {**row, **self.common}
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def measure(cfg: dict, names, backend: str, results: Results) -> dict:
    """Samples/s of each contender per repeat, interleaved, the order rotated."""
    samples = cfg["micro_batches"] * cfg["batch"]
    arrays = data(cfg, samples)
    models, reference = {}, None
    for name in names:
        started = time.perf_counter()
        model = compiled(name, cfg, reference)
        if reference is None:
            reference = model.get_weights()
        seconds = train_epoch(model, arrays, batch_of(name, cfg), backend)
        models[name] = model
        results.add({"kind": "warmup", "contender": name, "batch": batch_of(name, cfg),
                     "seconds": round(seconds, 4),
                     "build_seconds": round(time.perf_counter() - started - seconds, 4)})
        print(f"{name}: built and warmed up in {time.perf_counter() - started:.1f} s "
              f"(warm-up epoch {seconds:.1f} s)", flush=True)
    rates = {name: [] for name in names}
    for repeat in range(cfg["repeats"]):
        shift = repeat % len(names)
        for name in list(names[shift:]) + list(names[:shift]):
            seconds = train_epoch(models[name], arrays, batch_of(name, cfg), backend)
            rate = samples / seconds
            rates[name].append(rate)
            results.add({"kind": "rate", "contender": name, "repeat": repeat,
                         "batch": batch_of(name, cfg), "samples": samples,
                         "seconds": round(seconds, 4), "samples_per_s": round(rate, 3),
                         "tokens_per_s": round(rate * cfg["sequence"], 1)})
            print(f"repeat {repeat} {name}: {rate:.2f} samples/s ({seconds:.2f} s)",
                  flush=True)
    return rates


def ratio(rates: dict, top: str, bottom: str):
    """(median, min, max, per repeat) of the per-repeat ratios top / bottom, or None."""
    if top not in rates or bottom not in rates:
        return None
    pairs = [a / b for a, b in zip(rates[top], rates[bottom])]
    return statistics.median(pairs), min(pairs), max(pairs), pairs


RATIOS = (("accumulate", "plain"), ("accumulate", "builtin"), ("accumulate", "plain_kb"),
          ("builtin", "plain"), ("accumulate", "accumulate_one_step"),
          ("accumulate_one_step", "plain"))


def summarize(rates: dict, cfg: dict, results: Results) -> str:
    for name, values in rates.items():
        results.add({"kind": "summary", "contender": name, "batch": batch_of(name, cfg),
                     "samples_per_s": [round(v, 3) for v in values],
                     "median_samples_per_s": round(statistics.median(values), 3)})
    lines = ["| contender | batch | samples/s (median) | per repeat |",
             "| --- | ---: | ---: | --- |"]
    for name, values in rates.items():
        lines.append(f"| {name} | {batch_of(name, cfg)} | {statistics.median(values):.2f} | "
                     + ", ".join(f"{v:.2f}" for v in values) + " |")
    lines.append("")
    for top, bottom in RATIOS:
        r = ratio(rates, top, bottom)
        if r is None:
            continue
        results.add({"kind": "ratio", "ratio": f"{top}/{bottom}", "median": round(r[0], 4),
                     "min": round(r[1], 4), "max": round(r[2], 4),
                     "per_repeat": [round(v, 4) for v in r[3]]})
        lines.append(f"- {top} / {bottom}: {r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f}) "
                     f"over {len(r[3])} repeats")
    return "\n".join(lines)


def device_peak(backend: str, reset: bool = False) -> dict:
    """The backend's peak of device memory in MiB, or on a CPU the process's
    ru_maxrss; `reset` starts torch's anew (JAX's is the process's)."""
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            if reset:
                torch.cuda.reset_peak_memory_stats()
            return {"device_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                    "what": "torch.cuda.max_memory_allocated (reset after the warm-up)"}
    else:
        import jax

        d = jax.devices()[0]
        stats = d.memory_stats() if d.platform != "cpu" else None
        if stats and "peak_bytes_in_use" in stats:
            return {"device_peak_mib": round(stats["peak_bytes_in_use"] / 2**20, 1),
                    "what": "jax memory_stats peak_bytes_in_use (the process's)"}
    # ru_maxrss is in KiB on Linux.
    return {"device_peak_mib": None,
            "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                   1),
            "what": "no accelerator: the process's ru_maxrss (host memory)"}


def probe(cfg: dict, name: str, backend: str) -> dict:
    """One contender's peak memory in this process: a warm-up epoch, then one more."""
    arrays = data(cfg, cfg["micro_batches"] * cfg["batch"])
    model = compiled(name, cfg)
    train_epoch(model, arrays, batch_of(name, cfg), backend)
    device_peak(backend, reset=True)
    seconds = train_epoch(model, arrays, batch_of(name, cfg), backend)
    return {"kind": "memory", "contender": name, "batch": batch_of(name, cfg),
            "epoch_seconds": round(seconds, 4), **device_peak(backend)}


def size_args(cfg: dict) -> list[str]:
    out = []
    for key in SIZES:
        out += [f"--{key.replace('_', '-')}", str(cfg[key])]
    return out


def memory(cfg: dict, names, precision: str, results: Results) -> str:
    """Each contender's `probe` in a fresh process."""
    peaks = {}
    for name in names:
        started = time.perf_counter()
        out = subprocess.run(
            [sys.executable, __file__, "--only", name, "--memory-probe",
             "--precision", precision, *size_args(cfg)],
            capture_output=True, text=True, env=os.environ.copy())
        if out.returncode != 0:
            print(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}",
                  flush=True)
            results.add({"kind": "memory", "contender": name, "failed": out.returncode,
                         "stderr_tail": out.stderr[-2000:]})
            continue
        row = results.add(json.loads(out.stdout.strip().splitlines()[-1]))
        peaks[name] = row
        print(f"{name}: {row.get('device_peak_mib') or row.get('ru_maxrss_mib')} MiB "
              f"({row['what']}; {time.perf_counter() - started:.0f} s)", flush=True)

    def value(row):
        return row.get("device_peak_mib") or row.get("ru_maxrss_mib")

    what = next(iter(peaks.values()))["what"] if peaks else "-"
    lines = [f"Peak memory in MiB, each contender a fresh process ({what}).", "",
             "| contender | batch | peak MiB | / plain |", "| --- | ---: | ---: | ---: |"]
    for name in names:
        if name not in peaks:
            lines.append(f"| {name} | {batch_of(name, cfg)} | failed | - |")
            continue
        over = (f"{value(peaks[name]) / value(peaks['plain']):.3f}"
                if "plain" in peaks and value(peaks["plain"]) else "-")
        lines.append(f"| {name} | {batch_of(name, cfg)} | {value(peaks[name])} | {over} |")
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("float32", "mixed_bfloat16"),
                        default="float32")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model and run, seconds on a CPU (a smoke test)")
    parser.add_argument("--contenders", type=lambda s: s.split(","),
                        help=f"comma list of {', '.join(CONTENDERS)} (default: all)")
    parser.add_argument("--only", choices=CONTENDERS, help="one contender")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory, each contender in a fresh process")
    parser.add_argument("--memory-probe", action="store_true",
                        help="(internal) this process measures --only's peak memory")
    parser.add_argument("--out", type=pathlib.Path,
                        help="append each result as a JSON line to this file")
    for key in SIZES:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, dest=key,
                            help=f"default {FULL[key]} ({TINY[key]} with --tiny)")
    args = parser.parse_args(argv)
    cfg = {key: (getattr(args, key) if getattr(args, key) is not None
                 else (TINY if args.tiny else FULL)[key]) for key in SIZES}
    names = [args.only] if args.only else (args.contenders or list(CONTENDERS))
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.memory_probe and not args.only:
        parser.error("--memory-probe measures one contender: give --only")
    if cfg["steps"] < 2 and "builtin" in names:
        parser.error("Keras's gradient_accumulation_steps needs --steps >= 2")
    if cfg["micro_batches"] % cfg["steps"]:
        parser.error("--micro-batches must be a multiple of --steps (plain_kb trains "
                     "the same samples in micro_batches / steps batches)")
    if cfg["hidden"] % cfg["heads"]:
        parser.error("--hidden must be a multiple of --heads")
    return args, cfg, names


def main(argv=None):
    args, cfg, names = parse(argv)
    backend = check_backend()
    import keras

    keras.mixed_precision.set_global_policy(args.precision)
    if args.memory_probe:
        print(json.dumps({**probe(cfg, args.only, backend), "config": cfg}))
        return
    started = time.perf_counter()
    env = environment(backend)
    print(f"KERAS_BACKEND={backend}: training on {env['device']['name']} "
          f"({env['framework']}, Keras {env['keras']}, keras-hub {env['keras_hub']}, "
          f"Python {env['python']}); gradaccum from {env['gradaccum']}", flush=True)
    print(f"precision {args.precision}, b={cfg['batch']}, k={cfg['steps']}, sequence "
          f"{cfg['sequence']}, {cfg['layers']} layers, hidden {cfg['hidden']}, vocabulary "
          f"{cfg['vocabulary']}, {cfg['micro_batches']} micro-batches an epoch, "
          f"{cfg['repeats']} repeats; contenders {', '.join(names)}", flush=True)
    run_id = f"{backend}-{args.precision}-{int(time.time())}"
    results = Results(args.out, {"run": run_id, "backend": backend,
                                 "precision": args.precision, "micro_batch": cfg["batch"],
                                 "k": cfg["steps"], "sequence": cfg["sequence"]})
    results.add({"kind": "config", "mode": "memory" if args.memory else "throughput",
                 "contenders": names, "config": cfg, "environment": env,
                 "command": " ".join([f"KERAS_BACKEND={backend}", "python",
                                      "benchmarks/gpu.py",
                                      *(argv if argv is not None else sys.argv[1:])])})
    if args.memory:
        text = memory(cfg, names, args.precision, results)
    else:
        rates = measure(cfg, names, backend, results)
        text = summarize(rates, cfg, results)
    print(f"\nKERAS_BACKEND={backend}, {args.precision}, on {env['device']['name']} "
          f"({time.perf_counter() - started:.0f} s):\n{text}", flush=True)


if __name__ == "__main__":
    main()
