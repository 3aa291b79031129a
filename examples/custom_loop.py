"""TensorFlow: a custom training loop with gradaccum's GradientAccumulator.

For Keras's TensorFlow backend (it sets `KERAS_BACKEND` itself; the loop uses
`tf.GradientTape` and `tf.function`). For JAX see `jax_custom_loop.py`, for
PyTorch `torch_custom_loop.py`.

It trains a small classifier with micro-batches of unequal size (16, 16 and 8),
one optimizer update per window of 3 micro-batches (40 samples), and after the
data flushes the last window, which the data ends inside (16 + 4 samples). It
prints the largest gap between its weights and those of Keras's own step on each
window as one large batch: float rounding.

    python examples/custom_loop.py
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gradaccum  # noqa: E402


def make_model():
    return keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
         keras.layers.Dense(4)]
    )


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(420, 20)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    keras.utils.set_random_seed(0)  # the same initial weights on every run
    model, optimizer = make_model(), keras.optimizers.Adam(1e-2)
    # The reference trains each window as one batch with Keras's own step.
    reference = make_model()
    reference.set_weights(model.get_weights())
    accumulator = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)

    # reduce_retracing: one trace serves every micro-batch size after the first.
    @tf.function(reduce_retracing=True)
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        # Weight each micro-batch by its size: the update is exact for 16/16/8.
        return accumulator.step(optimizer, grads, weight=tf.shape(xb)[0])

    bounds = [(s + lo, s + hi) for s in range(0, 400, 40)
              for lo, hi in ((0, 16), (16, 32), (32, 40))]
    bounds += [(400, 416), (416, 420)]  # the data ends inside a window
    for lo, hi in bounds:
        train_step(x[lo:hi], y[lo:hi])
    # After the data: the open window (16 + 4 samples) is applied as a smaller batch.
    accumulator.apply(optimizer)

    # The same windows as large batches, with Keras's own training step.
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss_fn)
    for start in list(range(0, 400, 40)) + [400]:
        end = min(start + 40, 420)
        reference.train_on_batch(x[start:end], y[start:end])

    gap = max(
        float(np.abs(a - b).max())
        for a, b in zip(model.get_weights(), reference.get_weights())
    )
    accuracy = float((model(x).numpy().argmax(1) == y).mean())
    print(f"updates: {int(optimizer.iterations.numpy())} (micro-batches: {len(bounds)})")
    print(f"train accuracy: {accuracy:.3f}")
    print(f"max |weight - large-batch weight|: {gap:.2e}")
    return gap


if __name__ == "__main__":
    main()
