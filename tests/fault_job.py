"""A training job that can kill itself with SIGKILL, for tests/test_faults.py.

    python tests/fault_job.py fit|loop --dir DIR --out WEIGHTS.npz [--kill-at N]
        [--schedule]

`fit`: `gradaccum.wrap` + `fit` with `BackupAndRestore(save_freq=1)`, one
micro-batch per compiled call. `loop`: a custom loop with `GradientAccumulator` and
a `tf.train.CheckpointManager` saving model, optimizer, accumulator and the data
position after every micro-batch. Either way: 3 epochs of 5 micro-batches of 2,
steps 3 (windows 3 + 2 per epoch, the partial one flushed), Adam. With `--kill-at N`
the process sends itself SIGKILL right after micro-batch N (counted from 1 over the
whole run) has been trained on and saved; run again without it, the job resumes from
DIR and writes the final weights to OUT. With `--schedule`, `steps` is the ramp
`SCHEDULE` instead of 3: windows 1, 1, 2 and a flushed 1 in epoch 1, then 4 and a
flushed 1 in each later epoch.
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gradaccum  # noqa: E402

EPOCHS, BATCH, STEPS, SAMPLES = 3, 2, 3, 10
SCHEDULE = [(0, 1), (2, 2), (4, 4)]


def model_and_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.integers(0, 3, size=SAMPLES)
    return model, x, y


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfter(keras.callbacks.Callback):
    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            kill_self()


def run_fit(directory, kill_at, steps):
    model, x, y = model_and_data()
    trainer = gradaccum.wrap(model, steps=steps)
    trainer.compile(
        keras.optimizers.Adam(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=1,
    )
    callbacks = [keras.callbacks.BackupAndRestore(directory, save_freq=1)]
    if kill_at:
        callbacks.append(KillAfter(kill_at))  # after the backup of that micro-batch
    trainer.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                callbacks=callbacks)
    return model


def run_loop(directory, kill_at, steps):
    model, x, y = model_and_data()
    optimizer = keras.optimizers.Adam(0.05)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=steps)
    position = tf.Variable(0, dtype=tf.int64)  # micro-batches trained on so far
    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, accumulator=acc, position=position
    )
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def micro_batch(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return acc.step(optimizer, grads, weight=tf.shape(xb)[0])

    per_epoch = SAMPLES // BATCH
    while int(position) < EPOCHS * per_epoch:
        i = int(position) % per_epoch
        micro_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        if i == per_epoch - 1:
            acc.apply(optimizer)  # flush the epoch's partial window
        position.assign_add(1)
        manager.save()
        if int(position) == kill_at:
            kill_self()
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("fit", "loop"))
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--schedule", action="store_true")
    args = parser.parse_args()
    run = run_fit if args.mode == "fit" else run_loop
    model = run(args.dir, args.kill_at, SCHEDULE if args.schedule else STEPS)
    np.savez(args.out, *model.get_weights())


if __name__ == "__main__":
    main()
