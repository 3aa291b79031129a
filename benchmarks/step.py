"""The compiled training step alone, without `fit` around it: what gradaccum adds
inside the step, apart from the fixed cost each `fit` call pays outside it.

    KERAS_BACKEND=jax python benchmarks/step.py --workload mlp -b 8 -k 4
    KERAS_BACKEND=tensorflow python benchmarks/step.py --workload cnn -b 32 -k 1

Contenders as in `equal.py` (plain fit, Keras's built-in `gradient_accumulation_steps`
for k > 1, `accumulate`, and at every k `unscreened`: accumulate with
`nonfinite="apply"`; on `cnn_bn`, also `unfollowed`: accumulate with
`moving_statistics="micro_batch"`, its BatchNormalization layers not followed through
the window), each trained once through `fit` (which traces), then its step
called directly on one batch:

- JAX: the model's `train_step` jitted as Keras jits it (the state donated), called
  on the trainer's state;
- TensorFlow: the train function `fit` made, called on an iterator of the data
  (one micro-batch per call).

Printed: microseconds a call (the best and the median of `--rounds` rounds of
`--calls` calls, the contenders interleaved round by round, the order rotating), and
each contender's speed against plain fit as the median of the per-round ratios with
their interquartile range (neighbours in time, so a drift of the machine cancels:
on a shared machine whose speed swings, read the ratios, not the times); on JAX also
the number of arrays the step carries. Nothing is asserted.
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
sys.path.insert(0, str(HERE))


def trained(name: str, workload: str, b: int, k: int, x, y):
    """A model of `workload` compiled as contender `name` (as `equal.py` compiles
    it, one micro-batch per call) and fit on two batches."""
    import cells

    model = cells.compiled(name, workload, k, spe=1)
    model.fit(x[: 2 * b], y[: 2 * b], batch_size=b, epochs=1, shuffle=False, verbose=0)
    return model


def jax_caller(model, x, y, b):
    """`call()` runs the jitted step once; also the number of arrays it carries."""
    import jax
    import jax.numpy as jnp

    state = model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True,
        optimizer_variables=True, metrics_variables=True, purge_model_variables=False,
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    data = (jnp.asarray(x[:b]), jnp.asarray(y[:b]))
    holder = [state]

    def call(n):
        for _ in range(n):
            _, holder[0] = step(holder[0], data)
        jax.block_until_ready(holder[0])

    return call, len(jax.tree_util.tree_leaves(state))


def tf_caller(model, x, y, b):
    import tensorflow as tf

    iterator = iter(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(b, drop_remainder=True).repeat()
    )
    function = model.make_train_function()

    def call(n):
        for _ in range(n):
            logs = function(iterator)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, logs)

    return call, None


def main(argv=None):
    import keras
    import workloads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", choices=workloads.WORKLOADS)
    parser.add_argument("-b", type=int, default=8, help="micro-batch size")
    parser.add_argument("-k", type=int, default=4, help="micro-batches per window")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    x, y = workloads.data(args.workload, max(256, 4 * args.b))
    names = ["plain"] + (["builtin"] if args.k > 1 else []) + ["accumulate", "unscreened"]
    if args.workload == "cnn_bn":
        # Keras's BatchNormalization followed through the window, or not.
        names.append("unfollowed")
    make = jax_caller if backend == "jax" else tf_caller
    callers = {}
    for name in names:
        model = trained(name, args.workload, args.b, args.k, x, y)
        call, arrays = make(model, x, y, args.b)
        call(max(1, args.calls // 10))
        callers[name] = (call, arrays)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            callers[name][0](args.calls)
            times[name].append((time.perf_counter() - start) / args.calls)
    print(f"{backend}, {args.workload}, b={args.b}, k={args.k}: {args.rounds} rounds x "
          f"{args.calls} calls")
    for name in names:
        arrays = callers[name][1]
        carried = "" if arrays is None else f"  ({arrays} arrays carried)"
        speed = sorted(p / t for p, t in zip(times["plain"], times[name]))
        q = len(speed) // 4
        print(f"  {name:11s} best {min(times[name]) * 1e6:9.1f} us, median "
              f"{statistics.median(times[name]) * 1e6:9.1f} us a call;  speed / plain "
              f"{statistics.median(speed):.3f} (IQR {speed[q]:.3f}-{speed[-q - 1]:.3f})"
              f"{carried}")


if __name__ == "__main__":
    main()
