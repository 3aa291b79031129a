"""One worker of the MultiWorkerMirroredStrategy test, and its single-process reference.

Run as `python multiworker_job.py OUT.npz` with TF_CONFIG set. Under
MultiWorkerMirroredStrategy the worker trains three times from the same weights and
saves each result:

- `loop`: a custom loop (strategy.run + GradientAccumulator.step), each worker
  reading its own share of every global micro-batch (4 of 8 rows; the last batch of 5
  splits 4 / 1);
- `accumulate` and `wrap`: `fit()` with `gradaccum.accumulate` / `gradaccum.wrap`,
  steps=3, on the same arrays (Keras shards each global batch of 8 between the
  workers: 4 / 4, the last batch of 5 as 3 / 2), with accuracy and validation on 40
  rows, then `evaluate` on those rows;
- `scaled`: `fit()` with a LossScaleOptimizer on data with an inf in worker 0's
  share of one global batch.

It counts the cross-replica batch reductions (gradaccum's one per update) by
wrapping `strategy.extended.batch_reduce_to`. `single_process_reference()` trains
plain Keras on the same global windows in one process.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

N, GLOBAL_BATCH, STEPS, EPOCHS, WORKERS = 37, 8, 3, 2, 2  # windows of 3 and 2


def dataset_arrays():
    rng = np.random.default_rng(11)
    return rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, size=N)


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )


def optimizer():
    import keras

    return keras.optimizers.Adam(0.03)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def worker_rows(worker):
    """This worker's rows of every global micro-batch, in order."""
    share = GLOBAL_BATCH // WORKERS
    rows = []
    for start in range(0, N, GLOBAL_BATCH):
        end = min(start + GLOBAL_BATCH, N)
        rows.extend(range(min(start + worker * share, end), min(start + (worker + 1) * share, end)))
    return np.array(rows)


def global_windows():
    micro = [np.arange(s, min(s + GLOBAL_BATCH, N)) for s in range(0, N, GLOBAL_BATCH)]
    return [np.concatenate(micro[i:i + STEPS]) for i in range(0, len(micro), STEPS)]


# The loss-scaled run: row 9 is inf, in worker 0's share (rows 8-11) of the second
# global batch; that share is dropped with its weight.
POISONED_ROW, POISONED_SHARE = 9, np.arange(8, 12)


def poisoned_reference():
    """Weights after plain Keras steps on the global windows without the poisoned
    share, EPOCHS times."""
    x, y = dataset_arrays()
    model = build_model()
    model.compile(optimizer(), loss())
    for w in global_windows() * EPOCHS:
        kept = np.setdiff1d(w, POISONED_SHARE)
        model.train_on_batch(x[kept], y[kept])
    return model.get_weights()


def single_process_reference():
    """Weights after plain Keras steps on the global windows, EPOCHS times."""
    x, y = dataset_arrays()
    model = build_model()
    model.compile(optimizer(), loss(), metrics=["accuracy"])
    windows = global_windows() * EPOCHS
    for w in windows:
        model.train_on_batch(x[w], y[w])
    evaluation = model.evaluate(*evaluation_arrays(), batch_size=GLOBAL_BATCH, verbose=0)
    return {"loop": model.get_weights(), "loop_updates": len(windows),
            "evaluate": evaluation}


def evaluation_arrays():
    rng = np.random.default_rng(12)
    return rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 3, size=40)


def counting_reductions(strategy):
    """Counts, at run time, the batch reductions the strategy performs."""
    import tensorflow as tf

    count = tf.Variable(0, dtype=tf.int64, trainable=False)
    reduce = strategy.extended.batch_reduce_to

    def counted(*args, **kwargs):
        with tf.control_dependencies([count.assign_add(1)]):
            return reduce(*args, **kwargs)

    strategy.extended.batch_reduce_to = counted
    return count


def fit_loss_scaled(strategy, x, y, saved, count):
    """fit() with a LossScaleOptimizer (float32 policy: exact) on data whose row 9
    is inf: the share holding it is dropped, the scale backs off on every worker."""
    import keras

    import gradaccum

    bad = x.copy()
    bad[POISONED_ROW, 0] = np.inf
    start = int(count.numpy())
    with strategy.scope():
        model = build_model()
        trainer = gradaccum.accumulate(model, steps=STEPS)
        trainer.compile(keras.optimizers.LossScaleOptimizer(optimizer()), loss())
    history = trainer.fit(bad, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                          verbose=0)
    saved.update({f"scaled_{i}": w for i, w in enumerate(model.get_weights())})
    saved["scaled_skipped"] = history.history["skipped"]
    saved["scaled_scale"] = float(trainer.optimizer.dynamic_scale.numpy())
    saved["scaled_reductions"] = int(count.numpy()) - start


def fit_with(strategy, door, x, y, saved, count):
    import gradaccum

    start = int(count.numpy())
    with strategy.scope():
        model = build_model()
        trainer = getattr(gradaccum, door)(model, steps=STEPS)
        trainer.compile(optimizer(), loss(), metrics=["accuracy"])
    # Validation runs evaluate inside fit (the workaround is re-entrant).
    history = trainer.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                          verbose=0, validation_data=evaluation_arrays())
    saved.update({f"{door}_{i}": w for i, w in enumerate(model.get_weights())})
    saved[f"{door}_updates"] = int(trainer.optimizer.iterations.numpy())
    saved[f"{door}_logged_updates"] = history.history["updates"]
    saved[f"{door}_validation"] = [history.history["val_loss"][-1],
                                   history.history["val_accuracy"][-1]]
    saved[f"{door}_reductions"] = int(count.numpy()) - start
    saved[f"{door}_evaluate"] = trainer.evaluate(
        *evaluation_arrays(), batch_size=GLOBAL_BATCH, verbose=0
    )


PRIVACY = dict(l2_norm_clip=1.0, noise_multiplier=0.5)


def private_reference():
    """`accumulate` with `Privacy(seed=3)` in one process on the global batches."""
    import gradaccum

    x, y = dataset_arrays()
    trainer = gradaccum.accumulate(build_model(), steps=STEPS,
                                   privacy=gradaccum.Privacy(**PRIVACY, seed=3))
    trainer.compile(optimizer(), loss())
    trainer.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return trainer.get_weights()


def fit_private(strategy, x, y, saved):
    """fit() with `Privacy` on both workers: a seed given, then none (worker 0's
    draw is the one both use)."""
    import gradaccum

    for name, seed in (("private_seeded", 3), ("private_drawn", None)):
        with strategy.scope():
            model = build_model()
            trainer = gradaccum.accumulate(
                model, steps=STEPS, privacy=gradaccum.Privacy(**PRIVACY, seed=seed))
            trainer.compile(optimizer(), loss())
        trainer.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                    verbose=0)
        saved.update({f"{name}_{i}": w for i, w in enumerate(model.get_weights())})


def main(out_path):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import gradaccum

    x, y = dataset_arrays()

    def per_worker(context):
        rows = worker_rows(context.input_pipeline_id)
        ds = tf.data.Dataset.from_tensor_slices((x[rows], y[rows]))
        return ds.batch(GLOBAL_BATCH // WORKERS)

    saved = {}
    # A custom loop: strategy.run with GradientAccumulator.step.
    with strategy.scope():
        model = build_model()
        opt = optimizer()
        opt.build(model.trainable_variables)
        acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=STEPS)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_sample = keras.losses.sparse_categorical_crossentropy(
                yb, model(xb, training=True), from_logits=True
            )
            mean = tf.math.divide_no_nan(
                tf.reduce_sum(per_sample), tf.cast(tf.size(per_sample), per_sample.dtype)
            )
        grads = tape.gradient(mean, model.trainable_variables)
        return acc.step(opt, grads, weight=tf.shape(xb)[0])

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    dataset = strategy.distribute_datasets_from_function(per_worker)
    for _ in range(EPOCHS):
        for xb, yb in dataset:
            step(xb, yb)
        with strategy.scope():
            acc.apply(opt)  # the epoch's partial window
    saved.update({f"loop_{i}": w for i, w in enumerate(model.get_weights())})
    saved["loop_updates"] = int(opt.iterations.numpy())
    count = counting_reductions(strategy)
    for door in ("accumulate", "wrap"):
        fit_with(strategy, door, x, y, saved, count)
    fit_loss_scaled(strategy, x, y, saved, count)
    fit_private(strategy, x, y, saved)
    np.savez(out_path, **saved)


if __name__ == "__main__":
    main(sys.argv[1])
