"""What carrying accumulate's state through Keras's JAX `fit` costs, apart from its
step's work: plain fit; plain fit `carrying` as many more arrays through its compiled
step and as many more log entries as `accumulate` has (the arrays of the sums' shapes,
each changed by one elementwise op, the logs copies of the loss); the arrays alone,
the logs alone, the logs as one entry (an array: `logs packed`), the arrays as one
flat array of the sums' total size (`arrays flat`: one flat buffer of sums per
dtype); Keras's built-in
`gradient_accumulation_steps`; and `accumulate`. One micro-batch per call
(`steps_per_execution=1`), where Keras's loop pays per array and per log each call.

    KERAS_BACKEND=jax python benchmarks/carriage.py --workload mlp -b 8 -k 4

Printed: microseconds per micro-batch (median of `--rounds` epochs, contenders
interleaved, the order rotating) and each one's speed against plain fit as the median
of per-round ratios with their interquartile range. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def carried(model) -> int:
    """The number of arrays a model's jitted step carries."""
    import jax

    state = model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True,
        optimizer_variables=True, metrics_variables=True, purge_model_variables=False,
    )
    return len(jax.tree_util.tree_leaves(state))


def carrying(workload: str, arrays: int, logs: int, flat: bool = False,
             packed: bool = False):
    """Plain fit's model of `workload` carrying `arrays` more arrays (the trainable
    variables' shapes first, then scalars) and `logs` more log entries. `flat`: the
    trainable variables' shapes as one flat array of their total size (what one flat
    buffer of sums per dtype would carry). `packed`: the `logs` values as one log
    entry, an array of them."""
    import jax.numpy as jnp
    import keras
    import workloads

    class Carrying(keras.Model):
        def train_step(self, state, data):
            logs_, (trainable, non_trainable, optimizer, metrics) = super().train_step(
                state, data)
            extra = set(self.extra_slots)
            non_trainable = [v + 1 if i in extra else v for i, v in enumerate(non_trainable)]
            loss = logs_["loss"]
            values = [loss + i for i in range(logs)]
            if packed and values:
                logs_ = dict(logs_, carried=jnp.stack(values))
            else:
                logs_ = dict(logs_, **{f"carried_{i}": v for i, v in enumerate(values)})
            return logs_, (trainable, non_trainable, optimizer, metrics)

    base = workloads.build(workload)
    model = Carrying(base.inputs, base.outputs)
    shapes = [v.shape for v in model.trainable_variables][:arrays]
    scalars = arrays - len(shapes)
    if flat:
        shapes = [(sum(math.prod(shape) for shape in shapes),)]
    shapes += [()] * scalars
    before = len(model.non_trainable_variables)
    for i, shape in enumerate(shapes):
        model.add_weight(shape=shape, initializer="zeros", trainable=False, name=f"carried{i}")
    model.extra_slots = list(range(before, before + len(shapes)))
    model.compile(keras.optimizers.Adam(1e-3), workloads.loss())
    return model


def main(argv=None):
    import cells
    import keras
    import workloads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", choices=workloads.WORKLOADS)
    parser.add_argument("-b", type=int, default=8, help="micro-batch size")
    parser.add_argument("-k", type=int, default=4, help="micro-batches per window")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit("benchmarks/carriage.py measures Keras's JAX fit: KERAS_BACKEND=jax")
    x, y = workloads.data(args.workload, args.samples)
    fit = {"batch_size": args.b, "epochs": 1, "shuffle": False, "verbose": 0}
    models = {name: cells.compiled(name, args.workload, args.k, spe=1)
              for name in ("plain", "builtin", "accumulate")}
    logs = {name: model.fit(x, y, **fit).history for name, model in models.items()}
    arrays = carried(models["accumulate"]) - carried(models["plain"])
    extra_logs = len(set(logs["accumulate"]) - set(logs["plain"]))
    carriers = {
        "carrying": carrying(args.workload, arrays, extra_logs),
        "arrays only": carrying(args.workload, arrays, 0),
        "logs only": carrying(args.workload, 0, extra_logs),
        "logs packed": carrying(args.workload, 0, extra_logs, packed=True),
        "arrays flat": carrying(args.workload, arrays, 0, flat=True),
    }
    for model in carriers.values():
        model.fit(x, y, **fit)
    models = {"plain": models["plain"], **carriers,
              "builtin": models["builtin"], "accumulate": models["accumulate"]}
    names = list(models)
    per_batch = len(x) // args.b
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            models[name].fit(x, y, **fit)
            times[name].append((time.perf_counter() - start) / per_batch)
    print(f"jax, {args.workload}, b={args.b}, k={args.k}, steps_per_execution=1: "
          f"{args.rounds} rounds of {per_batch} micro-batches; carrying: "
          f"{arrays} more arrays, {extra_logs} more log entries")
    for name in names:
        speed = sorted(p / t for p, t in zip(times["plain"], times[name]))
        q = len(speed) // 4
        print(f"  {name:13s} {statistics.median(times[name]) * 1e6:7.1f} us a micro-batch;"
              f"  speed / plain {statistics.median(speed):.3f} "
              f"(IQR {speed[q]:.3f}-{speed[-q - 1]:.3f})")


if __name__ == "__main__":
    main()
