"""A training job whose model runs out of memory on micro-batches above a size, for
tests/test_split.py (micro_batch_size="auto").

    python tests/oom_job.py --limit N --out RESULT.npz [--reference] [--own-step]

The model's first layer raises `MemoryError` inside the graph (which TensorFlow
reports as `ResourceExhaustedError`, the error of a real out-of-memory) when it is
called on more than N samples. With `--reference` the same model (without the
fault) trains with plain Keras `fit` at the full batch. Either way: 100 samples in
batches of 40 (40, 40, 20), 3 epochs, Adam. RESULT holds the final weights, the
optimizer's variables, the fit history and, for the "auto" run, the size it chose
and the sizes that ran out of memory.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gradaccum  # noqa: E402

SAMPLES, BATCH, EPOCHS = 100, 40, 3


class OutOfMemoryAbove(keras.layers.Layer):
    """Identity on batches of at most `limit` samples; above, an allocation failure
    (a MemoryError raised in a py_function reaches TensorFlow as RESOURCE_EXHAUSTED)."""

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        limit = self.limit

        def check(n):
            if int(n) > limit:
                raise MemoryError(f"injected out-of-memory: {int(n)} > {limit} samples")
            return np.float32(0.0)

        zero = tf.py_function(check, [tf.shape(x)[0]], tf.float32)
        zero.set_shape([])
        return x + zero


class OutOfMemoryOnce(keras.layers.Layer):
    """Identity, but its `nth` call (counted from 1, over the whole run) runs out of
    memory: a transient failure, in the middle of a batch's micro-batches."""

    def __init__(self, nth, **kwargs):
        super().__init__(**kwargs)
        self.nth = nth
        self.calls = 0

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        def check(n):
            self.calls += 1
            if self.calls == self.nth:
                raise MemoryError(f"injected out-of-memory on call {self.calls}")
            return np.float32(0.0)

        zero = tf.py_function(check, [tf.shape(x)[0]], tf.float32)
        zero.set_shape([])
        return x + zero


def make_model(limit=None):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,))]
    if limit is not None:
        layers.append(OutOfMemoryAbove(limit))
    layers += [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def make_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.integers(0, 3, size=SAMPLES)
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    x, y = make_data()
    if args.reference:
        model = make_model()
    else:
        model = gradaccum.accumulate(make_model(args.limit), micro_batch_size="auto")
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    result = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    result.update(
        {f"optimizer_{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)}
    )
    result["history"] = np.array(json.dumps(history.history))
    if not args.reference:
        search = gradaccum.attach.accumulation_of(model).auto_size
        result["chosen"] = np.array(model.micro_batch_size)
        result["failures"] = np.array(search.failures, dtype=np.int64)
    np.savez(args.out, **result)


if __name__ == "__main__":
    main()
