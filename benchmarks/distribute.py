"""Communication and throughput under MirroredStrategy: gradaccum at steps 1, 4, 16.

    python benchmarks/distribute.py [--repeats 3] [--devices 2]

Every contender trains the experiment's MLP on the same data with a global micro-batch
of 32 under a MirroredStrategy whose cross-device ops count what they reduce
(`gradaccum.CountingCrossDeviceOps` around `ReductionToOneDevice`). Without a GPU the
replicas are logical CPU devices. Prints a Markdown table: bytes reduced per 1,000
samples, reductions per 1,000 samples, samples/s (median of the repeats). Keras's own
fit (one all-reduce per micro-batch) is the baseline. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, SAMPLES = 32, 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

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
    contenders = [("Keras fit (no accumulation)", None)] + [
        (f"gradaccum steps={k}", k) for k in (1, 4, 16)
    ]
    runs = {}
    for name, steps in contenders:
        ops = gradaccum.CountingCrossDeviceOps()
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        with strategy.scope():
            model = workloads.build("mlp")
            trainer = model if steps is None else gradaccum.wrap(model, steps=steps)
            trainer.compile(keras.optimizers.Adam(1e-3), workloads.loss())
        trainer.fit(x[:BATCH * 16], y[:BATCH * 16], batch_size=BATCH, verbose=0)  # trace
        ops.reset()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            times.append(time.perf_counter() - start)
        samples = SAMPLES * args.repeats
        runs[name] = dict(
            reductions=int(ops.reductions.numpy()) * 1000 / samples,
            bytes=int(ops.bytes.numpy()) * 1000 / samples,
            rate=SAMPLES / statistics.median(times),
        )
        print(name, runs[name], flush=True)

    base = runs[contenders[0][0]]
    print(f"\n{len(devices)} replicas ({', '.join(devices)}), MLP 784-128-10, global "
          f"micro-batch {BATCH}, Adam; TensorFlow {tf.__version__}, Keras {keras.__version__}\n")
    print("| contender | reductions / 1,000 samples | bytes reduced / 1,000 samples "
          "| vs Keras fit | samples/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, run in runs.items():
        ratio = run["bytes"] / base["bytes"] if base["bytes"] else float("nan")
        print(f"| {name} | {run['reductions']:.2f} | {run['bytes']:,.0f} | "
              f"{ratio:.3f}x | {run['rate']:,.0f} |")


if __name__ == "__main__":
    main()
