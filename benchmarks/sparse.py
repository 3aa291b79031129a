"""Sparse accumulation: per-micro-batch cost against the vocabulary size.

    python benchmarks/sparse.py [--repeats 3] [--micro-batches 200]

An Embedding(V, 64) -> mean pooling -> Dense(10) model, micro-batches of 32 sequences
of 32 token ids. One compiled call per micro-batch computes the gradients and adds
them to gradaccum's accumulators: the Embedding's gradient as the `tf.IndexedSlices`
it is (scatter-added), or densified first (`tf.convert_to_tensor`, what a dense
accumulator must do). The optimizer update (once per window, dense in Adam) is timed
apart. Prints a Markdown table of milliseconds per micro-batch (median of the
repeats) for V from 1,000 to 1,000,000. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

VOCABS = (1_000, 10_000, 100_000, 200_000, 1_000_000)
DIM, BATCH, LENGTH, CLASSES = 64, 32, 32, 10


def build(vocab):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(vocab, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(CLASSES),
        ]
    )


def measure(vocab, dense, micro_batches, repeats):
    """Milliseconds per micro-batch and per update for one configuration."""
    import keras
    import numpy as np
    import tensorflow as tf

    import gradaccum

    model = build(vocab)
    optimizer = keras.optimizers.Adam(1e-3)
    acc = gradaccum.GradientAccumulator(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.integers(0, vocab, size=(BATCH, LENGTH)), tf.int32)
    y = tf.constant(rng.integers(0, CLASSES, size=BATCH), tf.int32)

    @tf.function
    def micro_batch(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        acc.accumulate(grads, weight=BATCH)

    @tf.function
    def update():
        acc.apply(optimizer)

    micro_batch(x, y)
    update()
    micro_times, update_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(micro_batches):
            micro_batch(x, y)
        acc.micro_step.numpy()  # waits for the queued work
        micro_times.append((time.perf_counter() - start) / micro_batches * 1e3)
        start = time.perf_counter()
        update()
        acc.micro_step.numpy()
        update_times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(micro_times), statistics.median(update_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=200)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; Python "
        f"{platform.python_version()}, TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
    print(f"Command: python benchmarks/sparse.py --repeats {args.repeats} "
          f"--micro-batches {args.micro_batches}\n")
    print("| vocabulary | table parameters | sparse: ms / micro-batch | "
          "densified: ms / micro-batch | densified / sparse | update (Adam), ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for vocab in VOCABS:
        sparse_ms, update_ms = measure(vocab, False, args.micro_batches, args.repeats)
        dense_ms, _ = measure(vocab, True, args.micro_batches, args.repeats)
        print(
            f"| {vocab:,} | {vocab * DIM:,} | {sparse_ms:.3f} | {dense_ms:.3f} | "
            f"{dense_ms / sparse_ms:.1f}x | {update_ms:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
