"""Benchmark workloads: the experiment's MLP, a small CNN, a small Transformer encoder,
and the realistic KerasHub tasks of benchmarks/hub_workloads.py (`HUB_WORKLOADS`)."""

from __future__ import annotations

import pathlib
import platform

import hub_workloads
import keras
import numpy as np

WORKLOADS = ("mlp", "cnn", "cnn_bn", "transformer")
HUB_WORKLOADS = hub_workloads.NAMES
SEQ_LEN, VOCAB = 64, 1000


def build(name: str, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    if name in HUB_WORKLOADS:
        return hub_workloads.build(name)
    if name == "mlp":
        inputs = keras.Input((28, 28))
        h = keras.layers.Flatten()(inputs)
        h = keras.layers.Dense(128, activation="relu")(h)
        outputs = keras.layers.Dense(10)(h)
    elif name in ("cnn", "cnn_bn"):
        # cnn_bn: the same with Keras's BatchNormalization after each convolution.
        def normalized(h):
            return keras.layers.BatchNormalization()(h) if name == "cnn_bn" else h

        inputs = keras.Input((28, 28, 1))
        h = normalized(keras.layers.Conv2D(32, 3, activation="relu")(inputs))
        h = keras.layers.MaxPooling2D()(h)
        h = normalized(keras.layers.Conv2D(64, 3, activation="relu")(h))
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.Flatten()(h)
        outputs = keras.layers.Dense(10)(h)
    elif name == "transformer":
        inputs = keras.Input((SEQ_LEN,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 64)(inputs)
        a = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(128, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(64)(f))
        h = keras.layers.GlobalAveragePooling1D()(h)
        outputs = keras.layers.Dense(2)(h)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return keras.Model(inputs, outputs, name=name)


def data(name: str, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if name == "mlp":
        x = rng.random((n, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, n)
    elif name in ("cnn", "cnn_bn"):
        x = rng.random((n, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, n)
    else:
        x = rng.integers(0, VOCAB, (n, SEQ_LEN)).astype("int32")
        y = rng.integers(0, 2, n)
    return x, y


def fit_data(name: str, n: int, seed: int = 0) -> dict:
    """`fit`'s keyword arguments for n samples of any workload: `x`, `y` and, where the
    task weighs its targets (GPT-2's padding mask), `sample_weight`."""
    if name in HUB_WORKLOADS:
        return hub_workloads.data(name, n, seed)
    x, y = data(name, n, seed)
    return {"x": x, "y": y}


def head(arrays, n: int):
    """The first n samples of `fit_data`'s arguments (dicts of arrays included)."""
    if isinstance(arrays, dict):
        return {key: head(value, n) for key, value in arrays.items()}
    return arrays[:n]


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), for the tables' headers."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
