"""A custom training loop with gradaccum's GradientAccumulator.

Trains a small classifier with micro-batches of unequal size (16, 16, 8) and
checks that every update equals one step on the whole window of 40 samples.

    python examples/custom_loop.py
"""

import keras
import numpy as np
import tensorflow as tf

import gradaccum


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
         keras.layers.Dense(4)]
    )


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 20)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    model, optimizer = make_model(), keras.optimizers.Adam(1e-2)
    accumulator = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        # Weight each micro-batch by its size: the update is exact for 16/16/8.
        return accumulator.step(optimizer, grads, weight=tf.shape(xb)[0])

    reference, ref_optimizer = make_model(), keras.optimizers.Adam(1e-2)
    for start in range(0, 400, 40):
        for lo, hi in ((0, 16), (16, 32), (32, 40)):
            micro_step(x[start + lo : start + hi], y[start + lo : start + hi])
        with tf.GradientTape() as tape:
            loss = loss_fn(y[start : start + 40], reference(x[start : start + 40]))
        grads = tape.gradient(loss, reference.trainable_variables)
        ref_optimizer.apply_gradients(zip(grads, reference.trainable_variables))

    gap = max(
        float(np.abs(a - b).max())
        for a, b in zip(model.get_weights(), reference.get_weights())
    )
    accuracy = float((model(x).numpy().argmax(1) == y).mean())
    print(f"updates: {int(optimizer.iterations)} (micro-batches: 30)")
    print(f"train accuracy: {accuracy:.3f}")
    print(f"max |weight - large-batch weight|: {gap:.2e}")


if __name__ == "__main__":
    main()
