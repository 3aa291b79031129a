"""The contenders: each trains `n` micro-batches of size b, one update per k of them.

`make(name, workload, b, k)` returns a function `train(x, y)` that trains on all of x
(len(x) = n * b) and blocks until done. Building (and the first call, which traces)
is not timed by the caller.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from workloads import build, loss

import gradaccum

CONTENDERS = (
    "plain_b", "plain_B", "keras_builtin", "keras_builtin_window", "gradient_accumulator",
    "eager_list", "numpy_average", "gradaccum_fit", "gradaccum_accumulate", "gradaccum_loop",
    "gradaccum_split",
)


def _optimizer(**kwargs):
    return keras.optimizers.Adam(1e-3, **kwargs)


def _fit(model, batch_size, **compile_kwargs):
    model.compile(compile_kwargs.pop("optimizer", None) or _optimizer(), loss(),
                  **compile_kwargs)

    def train(x, y):
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)

    return train


def make(name: str, workload: str, b: int, k: int):
    model = build(workload)
    if name == "plain_b":
        return _fit(model, b)
    if name == "plain_B":
        return _fit(model, b * k)
    if name == "keras_builtin":
        return _fit(model, b, optimizer=_optimizer(gradient_accumulation_steps=k))
    if name == "keras_builtin_window":
        # Keras's built-in accumulation given gradaccum's default of one window per call.
        return _fit(model, b, optimizer=_optimizer(gradient_accumulation_steps=k),
                    steps_per_execution=k)
    if name == "gradient_accumulator":
        from gradient_accumulator import GradientAccumulateModel

        wrapped = GradientAccumulateModel(accum_steps=k, inputs=model.inputs,
                                          outputs=model.outputs)
        return _fit(wrapped, b)
    if name == "gradaccum_fit":
        return _fit(gradaccum.wrap(model, steps=k), b)
    if name == "gradaccum_accumulate":
        # The model's own fit, made to accumulate in place (same compile as the wrap).
        return _fit(gradaccum.accumulate(model, steps=k), b)
    if name == "gradaccum_split":
        # Split mode: fit gets batches of k*b, each split into k micro-batches of b.
        return _fit(gradaccum.accumulate(model, micro_batch_size=b), b * k)
    if name == "gradaccum_loop":
        return _custom_loop(model, b, k)
    if name == "eager_list":
        return _eager_list(model, b, k)
    if name == "numpy_average":
        return _numpy_average(model, b, k)
    raise ValueError(name)


def _custom_loop(model, b, k):
    optimizer, loss_fn = _optimizer(), loss()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=k)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        return acc.step(optimizer, grads, weight=tf.shape(x)[0])

    def train(x, y):
        for xb, yb in tf.data.Dataset.from_tensor_slices((x, y)).batch(b):
            step(xb, yb)
        acc.apply(optimizer)
        optimizer.iterations.numpy()

    return train


def _eager_list(model, b, k):
    """The source's style: an eager GradientTape loop summing Python lists."""
    optimizer, loss_fn = _optimizer(), loss()

    def train(x, y):
        summed, count = None, 0
        for start in range(0, len(x), b):
            with tf.GradientTape() as tape:
                value = loss_fn(y[start:start + b], model(x[start:start + b], training=True))
            grads = tape.gradient(value, model.trainable_variables)
            grads = [tf.convert_to_tensor(g) for g in grads]
            summed = grads if summed is None else [s + g for s, g in zip(summed, grads)]
            count += 1
            if count == k:
                optimizer.apply_gradients(zip([s / k for s in summed],
                                              model.trainable_variables))
                summed, count = None, 0

    return train


def _numpy_average(model, b, k):
    """The source's other style: gradients fetched to numpy and averaged there."""
    optimizer, loss_fn = _optimizer(), loss()

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        return [tf.convert_to_tensor(g) for g in
                tape.gradient(value, model.trainable_variables)]

    def train(x, y):
        window = []
        for start in range(0, len(x), b):
            window.append([g.numpy() for g in gradients(x[start:start + b],
                                                        y[start:start + b])])
            if len(window) == k:
                mean = [np.mean(parts, axis=0) for parts in zip(*window)]
                optimizer.apply_gradients(zip([tf.constant(m) for m in mean],
                                              model.trainable_variables))
                window = []

    return train
