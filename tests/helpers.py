"""What the tests share: small models with fixed weights, their data, the large-batch
references' gradients, and the two doors (`wrap` and `accumulate`) as one call.

Test modules import it as `from helpers import ...` (tests/ is on `sys.path`); the
fixtures and hooks live in tests/conftest.py, which imports no Keras, so that
pytest-xdist's controller process starts without it.
"""

from __future__ import annotations

import keras
import largebatch
import numpy as np

if keras.backend.backend() == "tensorflow":  # JAX's and torch's processes need none
    import tensorflow as tf

# The two doors: `gradaccum.wrap` (an AccumulatingModel trainer) and
# `gradaccum.accumulate` (the user's model trains with accumulation itself).
DOORS = ("wrap", "accumulate")

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
}


def make_mlp(seed: int = 0, dtype: str = "float32") -> keras.Model:
    """A 5 -> 8 -> 3 MLP whose initial weights depend only on `seed`."""
    return largebatch.mlp(seed, inputs=5, dtype=dtype)


def make_data(n: int, seed: int = 1):
    return largebatch.data(n, seed, features=5)


def mean_loss(model, x, y):
    """Per-sample mean cross-entropy: the micro-batch loss L_i = S_i / n_i."""
    logits = model(x, training=True)
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    )


def grads_of(model, x, y, loss=mean_loss):
    with tf.GradientTape() as tape:
        value = loss(model, x, y)
    return tape.gradient(value, model.trainable_variables)


def assert_same_state(model_a, opt_a, model_b, opt_b, rtol=1e-5, atol=1e-6):
    """Weights and every optimizer variable (slots, iterations) agree."""
    for a, b in zip(model_a.get_weights(), model_b.get_weights()):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    assert len(opt_a.variables) == len(opt_b.variables)
    for va, vb in zip(opt_a.variables, opt_b.variables):
        np.testing.assert_allclose(
            np.asarray(va), np.asarray(vb), rtol=rtol, atol=atol, err_msg=va.path
        )


def make_trainer(door, model, **options):
    """What to compile and fit: `wrap`'s trainer, or `model` itself accumulating."""
    import gradaccum

    if door == "wrap":
        return gradaccum.wrap(model, **options)
    if door == "accumulate":
        return gradaccum.accumulate(model, **options)
    raise ValueError(f"unknown door {door!r}")


def trained(door, trainer):
    """The Keras model that holds the trained weights."""
    return trainer.model if door == "wrap" else trainer


def fit_state(trainer):
    """The accumulation state of fit (None before the first training step)."""
    import gradaccum

    if isinstance(trainer, gradaccum.AccumulatingModel):
        return trainer._fit_state
    return gradaccum.attach.accumulation_of(trainer).state
