"""What crosses devices per update, and what each device holds, under
keras.distribution.DataParallel on JAX, for N = 1, 2, 4, 8 virtual CPU devices.

    python benchmarks/jax_distribution.py [--devices 1 2 4 8] [--k 4] [--b 32]

For each N (a child process each: JAX fixes its devices when it starts) it compiles
the train step Keras runs (jitted with the state's shardings, as Keras's trainer
does) for plain Keras at batch k x b, and for gradaccum with `steps=k` at batch b and
split mode (`micro_batch_size=b`) at batch k x b, each with `sums="reduced"` (every
micro-batch's gradient all-reduced), `"local"` (each device's own sums, added once
per update) and `"sharded"` (1/N of the sums on each device). From XLA's optimized
HLO (`benchmarks/hlo.py`) it reads every collective and where it runs (every call,
split mode's loop, the update's branch) and gives per update:

- the collectives of more than 64 bytes (a gradient's), by kind; the scalar ones
  (normalizers, weights, flags) are counted apart;
- the bytes each device sends for them, as a ring algorithm sends them: 2(N-1)/N of
  an all-reduce's size, (N-1) times a reduce-scatter's result (its shard), (N-1)/N
  of an all-gather's result;
- the bytes device 0 holds for the sums between micro-batches (steps mode's state;
  split mode's sums live inside the step and are laid out the same way);
- the largest gap of the weights from one device after two updates (k micro-batches
  of b, Adam).

The model is the MLP of benchmarks/jax_builtin.py (784-512-512-10, Adam; its
gradient is 2.55 MiB in float32). Nothing is timed: CPU "devices" share one
memory, so their collectives are memory copies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
parser.add_argument("--k", type=int, default=4, help="micro-batches per update")
parser.add_argument("--b", type=int, default=32, help="micro-batch size")
parser.add_argument("--json", default=None, help="also write the rows here")
parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
args = parser.parse_args()

SCALAR = 64  # bytes: collectives at most this size are scalars (weights, flags)


def child(devices: int, k: int, b: int) -> list:
    """The rows for N = `devices` (run in a process with that many devices)."""
    import jax
    import keras
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hlo import train_step_collectives
    from jax_builtin import data, mlp

    import gradaccum
    from gradaccum.attach import accumulation_of

    x, y = data(2 * k * b)

    def make(options):
        model = mlp()
        if options is not None:
            model = gradaccum.accumulate(model, **options)
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def trained(options, batch, distributed):
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices()[:devices])
            if distributed else None)
        model = make(options)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return model

    def held(model) -> int:
        accumulation = accumulation_of(model)
        if accumulation is None or accumulation.options.split:
            return 0
        device = jax.devices()[0]
        return sum(shard.data.nbytes for acc in accumulation.state.accumulators
                   for shard in acc.value.addressable_shards if shard.device == device)

    gradient = None
    rows = []
    runs = [(f"plain Keras, batch {k * b}", None, k * b, 1, 0)]
    for sums in ("reduced", "local", "sharded"):
        runs.append((f"steps={k}, sums={sums!r}", {"steps": k, "sums": sums}, b, k, 0))
    for sums in ("reduced", "local", "sharded"):
        runs.append((f"micro_batch_size={b}, sums={sums!r}",
                     {"micro_batch_size": b, "sums": sums}, k * b, 1, k))
    for label, options, batch, calls, loops in runs:
        reference = trained(options, batch, distributed=False)
        model = trained(options, batch, distributed=True)
        if gradient is None:
            gradient = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        gap = max(float(np.max(np.abs(a - c)))
                  for a, c in zip(model.get_weights(), reference.get_weights()))
        counts = {"all-reduce": 0, "reduce-scatter": 0, "all-gather": 0, "scalar": 0}
        sent = 0.0
        if devices > 1:
            for found in train_step_collectives(model, (x[:batch], y[:batch])):
                times = {"call": calls, "loop": loops, "update": 1}[found.place]
                if found.bytes <= SCALAR:
                    counts["scalar"] += times
                    continue
                counts[found.kind] = counts.get(found.kind, 0) + times
                n = devices
                share = {"all-reduce": 2 * (n - 1) / n * found.bytes,
                         "reduce-scatter": (n - 1) * found.bytes,
                         "all-gather": (n - 1) / n * found.bytes}.get(found.kind, 0.0)
                sent += share * times
        rows.append({"devices": devices, "run": label, "per_update": counts,
                     "sent_bytes": sent, "held_bytes": held(model),
                     "gradient_bytes": gradient, "gap": gap})
        keras.distribution.set_distribution(None)
    return rows


def main():
    if args.child is not None:
        print(json.dumps(child(args.child, args.k, args.b)))
        return
    rows = []
    for devices in args.devices:
        env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                              + f" --xla_force_host_platform_device_count={devices}"))
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(devices), "--k", str(args.k),
             "--b", str(args.b)], capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    print(f"DataParallel, k={args.k}, b={args.b}; gradient "
          f"{rows[0]['gradient_bytes'] / mib:.2f} MiB (float32)")
    print("| N | run | all-reduce / reduce-scatter / all-gather per update (scalar) "
          "| MiB sent per device per update | MiB device 0 holds for the sums "
          "| gap from one device |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for row in rows:
        c = row["per_update"]
        held = f"{row['held_bytes'] / mib:.2f}" if row["held_bytes"] else "-"
        print(f"| {row['devices']} | {row['run']} | {c['all-reduce']} / "
              f"{c['reduce-scatter']} / {c['all-gather']} ({c['scalar']}) | "
              f"{row['sent_bytes'] / mib:.2f} | {held} | {row['gap']:.1e} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
