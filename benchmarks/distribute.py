"""Communication and throughput under tf.distribute: gradaccum against Keras's own fit.

    python benchmarks/distribute.py [--repeats 3] [--devices 2]   # MirroredStrategy
    python benchmarks/distribute.py --workers 2 [--repeats 3]      # 2 worker processes

MirroredStrategy rows: every contender trains the experiment's MLP (with a
BatchNormalization layer after its hidden layer in the batch-norm rows) on the same
data, global micro-batch 32, under a MirroredStrategy whose cross-device ops count
what they reduce (`gradaccum.CountingCrossDeviceOps` around `ReductionToOneDevice`);
`mixed_float16` rows train under that policy (Keras's LossScaleOptimizer). Without a
GPU the replicas are logical CPU devices.

`--workers 2`: the same MLP under MultiWorkerMirroredStrategy, two processes on
127.0.0.1 (one CPU replica each); the strategy's batch reductions and replica
all-reduces are counted by wrapping them. Keras's own fit runs there with gradaccum's
workaround for the Keras failures (`backends.tensorflow.keras_compat.across_workers`).

Prints a Markdown table: reductions and bytes reduced per 1,000 samples, bytes against
Keras fit under the same conditions, samples/s (median of the repeats). Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, SAMPLES = 32, 8192

# (name, window (None: Keras's fit; an int: `steps`; a dict: wrap's window options),
# policy, batch normalization: None, "keras", "gradaccum" or "synchronized")
MIRRORED = [
    ("Keras fit (no accumulation)", None, "float32", None),
    ("gradaccum steps=1", 1, "float32", None),
    ("gradaccum steps=4", 4, "float32", None),
    ("gradaccum steps=16", 16, "float32", None),
    # 128 samples per update: the windows of steps=4, decided by a budget (one scalar
    # all-reduce per micro-batch on top of the update's reduction).
    ("gradaccum weight_per_update=128", {"weight_per_update": 128}, "float32", None),
    ("Keras fit, mixed_float16", None, "mixed_float16", None),
    ("gradaccum steps=4, mixed_float16", 4, "mixed_float16", None),
    ("Keras fit, BatchNormalization", None, "float32", "keras"),
    ("gradaccum steps=4, gradaccum.BatchNormalization", 4, "float32", "gradaccum"),
    ("gradaccum steps=4, BatchNormalization synchronized", 4, "float32", "synchronized"),
]
WORKERS = [
    ("Keras fit (no accumulation), 2 workers", None, "float32", None),
    ("gradaccum steps=1, 2 workers", 1, "float32", None),
    ("gradaccum steps=4, 2 workers", 4, "float32", None),
    ("gradaccum steps=16, 2 workers", 16, "float32", None),
]


def build(batch_norm):
    import keras

    import gradaccum

    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28))
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(128, activation="relu")(h)
    if batch_norm == "keras":
        h = keras.layers.BatchNormalization()(h)
    elif batch_norm:
        h = gradaccum.BatchNormalization(synchronized=batch_norm == "synchronized")(h)
    outputs = keras.layers.Dense(10)(h)
    return keras.Model(inputs, outputs, name="mlp")


def train(strategy, contender, x, y, repeats, counter):
    """Trains one contender; returns its counts per 1,000 samples and its rate."""
    import keras

    import gradaccum
    from gradaccum.backends.tensorflow import keras_compat as kc

    name, window, policy, batch_norm = contender
    keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope():
            model = build(batch_norm)
            options = window if isinstance(window, dict) else dict(steps=window)
            trainer = model if window is None else gradaccum.wrap(model, **options)
            trainer.compile(keras.optimizers.Adam(1e-3),
                            keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with kc.across_workers(trainer):  # Keras's own fit under several workers
            trainer.fit(x[:BATCH * 16], y[:BATCH * 16], batch_size=BATCH, verbose=0)
            counter.reset()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
                times.append(time.perf_counter() - start)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    samples = len(x) * repeats
    return dict(
        reductions=int(counter.reductions.numpy()) * 1000 / samples,
        bytes=int(counter.bytes.numpy()) * 1000 / samples,
        rate=len(x) / statistics.median(times),
    )


class StrategyCounter:
    """Counts, at run time, the batch reductions and replica all-reduces of a
    MultiWorkerMirroredStrategy (its cross-device ops are not replaceable), with
    the bytes of one replica's payload."""

    def __init__(self, strategy):
        import tensorflow as tf

        self.reductions = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.bytes = tf.Variable(0, dtype=tf.int64, trainable=False)
        extended = strategy.extended

        def payload(values):
            total = 0
            for value in tf.nest.flatten(values, expand_composites=False):
                if isinstance(value, tf.distribute.DistributedValues):
                    value = strategy.experimental_local_results(value)[0]
                total += value.shape.num_elements() * value.dtype.size
            return total

        def counted(method, values_of):
            def run(*args, **kwargs):
                size = payload(values_of(*args, **kwargs))
                with tf.control_dependencies(
                    [self.reductions.assign_add(1), self.bytes.assign_add(size)]
                ):
                    return method(*args, **kwargs)

            return run

        extended.batch_reduce_to = counted(
            extended.batch_reduce_to, lambda op, pairs, *a, **k: [v for v, _ in pairs]
        )
        # Keras's optimizer all-reduces the gradients from the replica context.
        extended._replica_ctx_all_reduce = counted(
            extended._replica_ctx_all_reduce, lambda op, value, *a, **k: value
        )

    def reset(self):
        self.reductions.assign(0)
        self.bytes.assign(0)


def table(runs, title):
    base = {}
    print(f"\n{title}\n")
    print("| contender | reductions / 1,000 samples | bytes reduced / 1,000 samples "
          "| bytes vs Keras fit | samples/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, run in runs.items():
        if name.startswith("Keras fit"):
            base = run
        ratio = run["bytes"] / base["bytes"] if base.get("bytes") else float("nan")
        print(f"| {name} | {run['reductions']:.2f} | {run['bytes']:,.0f} | "
              f"{ratio:.3f}x | {run['rate']:,.0f} |")


def mirrored(args) -> None:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= args.devices:
        devices = [f"/gpu:{i}" for i in range(args.devices)]
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices
        )
        devices = [f"/cpu:{i}" for i in range(args.devices)]
    import keras
    import workloads

    import gradaccum

    x, y = workloads.data("mlp", SAMPLES)
    runs = {}
    for contender in MIRRORED:
        ops = gradaccum.CountingCrossDeviceOps()
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        runs[contender[0]] = train(strategy, contender, x, y, args.repeats, ops)
        print(contender[0], runs[contender[0]], flush=True)
    table(runs, f"{len(devices)} replicas ({', '.join(devices)}), MLP 784-128-10, global "
          f"micro-batch {BATCH}, Adam; TensorFlow {tf.__version__}, Keras "
          f"{keras.__version__}")


def worker(args) -> None:
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import workloads

    x, y = workloads.data("mlp", SAMPLES)
    counter = StrategyCounter(strategy)
    runs = {c[0]: train(strategy, c, x, y, args.repeats, counter) for c in WORKERS}
    if args.worker_index == 0:
        with open(args.out, "w") as f:
            json.dump(runs, f)


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def workers(args) -> None:
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "runs.json")
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(args.workers)]}
    procs = []
    try:
        for index in range(args.workers):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker-index", str(index), "--out", out,
                 "--repeats", str(args.repeats)], env=env))
        for proc in procs:
            proc.wait(timeout=1800)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(p.returncode for p in procs):
        sys.exit("a worker failed")
    import keras
    import tensorflow as tf

    with open(out) as f:
        runs = json.load(f)
    table(runs, f"MultiWorkerMirroredStrategy, {args.workers} worker processes on "
          f"127.0.0.1 (one CPU replica each), MLP 784-128-10, global micro-batch {BATCH}, "
          f"Adam; TensorFlow {tf.__version__}, Keras {keras.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0,
                        help="run under MultiWorkerMirroredStrategy with this many processes")
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_index is not None:
        worker(args)
    elif args.workers:
        workers(args)
    else:
        mirrored(args)


if __name__ == "__main__":
    main()
