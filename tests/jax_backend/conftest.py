"""The JAX suite: run in a process of its own with KERAS_BACKEND=jax (Keras fixes its
backend per process): `KERAS_BACKEND=jax python -m pytest tests/jax_backend`, as
`scripts/test.sh` does."""

import pytest


def pytest_collection_modifyitems(config, items):
    import keras  # here, not at import: xdist's controller loads this file too

    if keras.backend.backend() != "jax":
        raise pytest.UsageError(
            "tests/jax_backend runs with Keras's JAX backend. Received: "
            f"keras.backend.backend()={keras.backend.backend()!r}. Run "
            "`KERAS_BACKEND=jax python -m pytest tests/jax_backend`."
        )
