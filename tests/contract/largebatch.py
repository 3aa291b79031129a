"""Small models with fixed weights and their references: plain Keras (on the process's
backend) trained on the concatenated windows. Keras and NumPy only: every backend's
tests use them."""

from __future__ import annotations

import keras
import numpy as np

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed: int = 0, *, inputs: int = 6, dtype: str | None = None) -> keras.Model:
    """An `inputs` -> 8 -> 3 MLP whose initial weights depend only on `seed` (its
    layers in `dtype`, or the global dtype policy's)."""
    model = keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(8, activation="tanh", dtype=dtype),
        keras.layers.Dense(3, dtype=dtype),
    ])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def data(n: int, seed: int = 1, *, features: int = 6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def windows_of(sizes, window_lengths):
    """Index arrays of the windows: micro-batches of `sizes` (in order) grouped by
    `window_lengths` (micro-batches per window)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out, i = [], 0
    for length in window_lengths:
        out.append(np.arange(starts[i], starts[i + length]))
        i += length
    return out


def reference_fit(model, windows, x, y, sample_weight=None, epochs=1):
    """Plain Keras on JAX, one `train_on_batch` per window (per epoch)."""
    for _ in range(epochs):
        for index in windows:
            sw = None if sample_weight is None else sample_weight[index]
            model.train_on_batch(x[index], y[index], sample_weight=sw)
    return model


def max_gap(a, b) -> float:
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def assert_weights_close(a, b, rtol=1e-5, atol=1e-6):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol)


def assert_optimizer_close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a.variables) == len(b.variables)
    for u, v in zip(a.variables, b.variables):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol,
                                   err_msg=u.path)


class OwnLoss(keras.Model):
    """A subclassed model with its own `compute_loss` (an extra L2 term on outputs)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.01 * keras.ops.mean(keras.ops.square(y_pred))


def own_loss(seed=0):
    """An `OwnLoss` whose weights depend only on `seed`."""
    model = OwnLoss()
    model(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


class KerasIoStep(keras.Model):
    """A model with its own `train_step` in keras.io's pattern for the process's
    backend: forward, `compute_loss`, the loss scaled as Keras's default step scales
    it (`optimizer.scale_loss`: unchanged without loss scaling), backward, one
    `optimizer.apply`. Subclasses give `call`."""

    def train_step(self, *args):
        backend = keras.backend.backend()
        if backend == "jax":
            return self._jax_step(*args)
        x, y = args[0]
        if backend == "torch":
            import torch

            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self.zero_grad()
            self.optimizer.scale_loss(loss).backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {}

    def _jax_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def objective(trainable):
            y_pred, _ = self.stateless_call(trainable, non_trainable, x, training=True)
            loss = self.compute_loss(x, y, y_pred)
            with keras.StatelessScope(state_mapping=list(zip(
                    self.optimizer.variables, optimizer_variables))):
                return self.optimizer.scale_loss(loss)

        grads = jax.grad(objective)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)
