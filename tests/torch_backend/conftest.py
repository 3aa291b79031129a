"""The PyTorch suite: run in a process of its own with KERAS_BACKEND=torch (Keras fixes its
backend per process): `KERAS_BACKEND=torch python -m pytest tests/torch_backend`, as
`scripts/test.sh` does."""

import pytest


def pytest_collection_modifyitems(config, items):
    import keras  # here, not at import: xdist's controller loads this file too

    if keras.backend.backend() != "torch":
        raise pytest.UsageError(
            "tests/torch_backend runs with Keras's PyTorch backend. Received: "
            f"keras.backend.backend()={keras.backend.backend()!r}. Run "
            "`KERAS_BACKEND=torch python -m pytest tests/torch_backend`."
        )
