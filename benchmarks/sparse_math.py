"""Sparse gradients with repeated rows: each optimizer against its own dense math.

    KERAS_BACKEND=tensorflow python benchmarks/sparse_math.py

A 12-row Embedding(12, 4) -> mean pooling -> Dense(3) model, 16 sequences of 5 ids
drawn from 4 rows (every batch hits some row several times), 4 updates on windows of
4 sequences. For each optimizer, the table after training is set against the same
optimizer fed each window's gradient densified (`tf.convert_to_tensor`: the
gradient's math): plain Keras fit at batch 4, `gradaccum.accumulate(steps=1)` at
batch 4 and `steps=2` at batch 2 (the same windows). Prints a Markdown table of the
largest absolute differences. Nothing is timed or asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gradaccum  # noqa: E402

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {
    "Adam": lambda: keras.optimizers.Adam(0.05),
    "AdamW": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.05),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.1),
    "Lion": lambda: keras.optimizers.Lion(0.01),
}


def model():
    m = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(12, 4),
                          keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    m.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in m.get_weights()])
    return m


def table_after(name, mode, x, y):
    m = model()
    if mode == "dense":
        optimizer = OPTIMIZERS[name]()
        for start in range(0, len(x), 4):
            with tf.GradientTape() as tape:
                loss = SCE(y[start:start + 4], m(x[start:start + 4], training=True))
            grads = tape.gradient(loss, m.trainable_variables)
            optimizer.apply([tf.convert_to_tensor(g) for g in grads], m.trainable_variables)
        return m.get_weights()[0]
    steps = {"keras": None, "steps=1": 1, "steps=2": 2}[mode]
    if steps is not None:
        gradaccum.accumulate(m, steps=steps)
    m.compile(OPTIMIZERS[name](), SCE)
    m.fit(x, y, batch_size=4 // (steps or 1), epochs=1, shuffle=False, verbose=0)
    return m.get_weights()[0]


def main():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(16, 5)).astype("int32")
    y = rng.integers(0, 3, size=(16,))
    print("| optimizer | plain Keras | gradaccum steps=1 | gradaccum steps=2 |")
    print("| --- | ---: | ---: | ---: |")
    for name in OPTIMIZERS:
        dense = table_after(name, "dense", x, y)
        gaps = [float(np.abs(table_after(name, mode, x, y) - dense).max())
                for mode in ("keras", "steps=1", "steps=2")]
        print(f"| {name} | " + " | ".join(f"{g:.2g}" for g in gaps) + " |")


if __name__ == "__main__":
    main()
