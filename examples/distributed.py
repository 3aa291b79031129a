"""TensorFlow: gradient accumulation under tf.distribute, one all-reduce per update.

    python examples/distributed.py                  # MirroredStrategy on this machine
    TF_CONFIG='...' python examples/distributed.py  # one worker of a multi-worker job

On one machine the replicas are its GPUs, or two logical CPU devices when it has
fewer than two GPUs. With TF_CONFIG set (see docs/distribution.md) the script is one
worker of a MultiWorkerMirroredStrategy job: every worker runs the same command with
its own `task.index`. Either way it trains with `fit()`, then with a custom loop.
Each replica accumulates its share of every micro-batch locally; replicas
communicate once per update, not once per micro-batch.
"""

from __future__ import annotations

import json
import os

os.environ["KERAS_BACKEND"] = "tensorflow"  # tf.distribute is TensorFlow's
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

STEPS, GLOBAL_BATCH = 4, 64


def strategy_for_this_process():
    if os.environ.get("TF_CONFIG"):
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= 2:
        return tf.distribute.MirroredStrategy()
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:  # TensorFlow has started already: its devices stay
        pass
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def build_model():
    import keras

    return keras.Sequential([
        keras.Input((28, 28)),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def data(n=4096, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.random((n, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


def train_with_fit(strategy):
    import keras

    import gradaccum

    x, y = data()
    with strategy.scope():  # model, wrapper and optimizer: all inside the scope
        trainer = gradaccum.wrap(build_model(), steps=STEPS)
        trainer.compile(
            optimizer=keras.optimizers.Adam(1e-3, global_clipnorm=1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = trainer.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
    print("updates:", history.history["updates"])


def train_with_a_custom_loop(strategy):
    import keras

    import gradaccum

    x, y = data()
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=STEPS)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_sample = keras.losses.sparse_categorical_crossentropy(
                yb, model(xb, training=True), from_logits=True
            )
            # The replica's own mean (not divided by the number of replicas, as
            # Keras loss objects do inside strategy.run); 0 on an empty share.
            loss = tf.math.divide_no_nan(
                tf.reduce_sum(per_sample), tf.cast(tf.size(per_sample), tf.float32)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        return acc.step(optimizer, grads, weight=tf.shape(xb)[0])

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    )
    for epoch in range(2):
        for xb, yb in dataset:
            step(xb, yb)
        with strategy.scope():
            acc.apply(optimizer)  # the epoch's partial window
        print(f"epoch {epoch + 1}: updates {int(optimizer.iterations.numpy())}")


if __name__ == "__main__":
    strategy = strategy_for_this_process()
    print(f"{type(strategy).__name__}: {strategy.num_replicas_in_sync} replicas")
    if os.environ.get("TF_CONFIG"):
        print("task:", json.loads(os.environ["TF_CONFIG"])["task"])
    train_with_fit(strategy)
    train_with_a_custom_loop(strategy)
