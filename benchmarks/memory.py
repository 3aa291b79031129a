"""Peak memory of one training run, measured in a fresh process.

    python benchmarks/memory.py --workload transformer --mode plain --batch 2048
    python benchmarks/memory.py --workload transformer --mode gradaccum --batch 32 --steps 64
    python benchmarks/memory.py --mode split --batch 2048 --micro-batch-size 32

Prints one JSON line: the resident set before the measured fit (model built, compiled
and traced) and its peak during the fit (sampled every 2 ms), in MiB, and on a GPU
the peak of tf.config.experimental.get_memory_info.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakSampler(threading.Thread):
    """Samples the resident set every 2 ms: the peak while training runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = rss_mib()
        self._done = threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(0.002)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return max(self.peak, rss_mib())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--mode", choices=("plain", "gradaccum", "split"), required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="split mode: gradaccum.accumulate(micro_batch_size=...)")
    args = parser.parse_args()

    import keras
    import tensorflow as tf
    from workloads import build, data, loss

    import gradaccum

    model = build(args.workload)
    if args.mode == "gradaccum":
        trainer = gradaccum.wrap(model, steps=args.steps)
    elif args.mode == "split":
        trainer = gradaccum.accumulate(model, micro_batch_size=args.micro_batch_size)
    else:
        trainer = model
    trainer.compile(keras.optimizers.Adam(1e-3), loss())
    n = args.batch * args.steps * args.updates
    x, y = data(args.workload, n)
    gpu = tf.config.list_physical_devices("GPU")
    # Warm-up on one window (traces), then measure a fresh run of `updates` windows.
    trainer.fit(x[: args.batch * args.steps], y[: args.batch * args.steps],
                batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    before = rss_mib()
    sampler = PeakSampler()
    sampler.start()
    trainer.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    peak = sampler.stop()
    result = {
        "mode": args.mode, "batch": args.batch, "steps": args.steps,
        "micro_batch_size": args.micro_batch_size,
        "effective_batch": args.batch * args.steps,
        "rss_before_mib": round(before, 1), "peak_rss_mib": round(peak, 1),
    }
    if gpu:
        info = tf.config.experimental.get_memory_info("GPU:0")
        result["gpu_peak_mib"] = round(info["peak"] / 2**20, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
