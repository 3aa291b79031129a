"""Which adapter runs: Keras's backend decides, once per process.

`ADAPTERS` is the one list of the backends gradaccum trains on; a name that runs on
some of them only says so (`ONLY_ON`). Keras is imported when first asked for: the
command line checks its arguments without it.
"""

from __future__ import annotations

import importlib

from gradaccum import _tf

# Keras's backends gradaccum trains on, and the module of each one's adapter (its
# `Accumulation`, a `gradaccum.adapter.Accumulation`).
ADAPTERS = {
    "tensorflow": "gradaccum.backends.tensorflow.fit",
    "jax": "gradaccum.backends.jax.fit",
    "torch": "gradaccum.backends.torch.fit",
}
# Public names that run on some backends only, and those backends.
ONLY_ON = {
    "BatchNormalization": ("tensorflow",),
    "CountingCrossDeviceOps": ("tensorflow",),
    "convert_batch_normalization": ("tensorflow",),
}
# How the messages name each backend.
NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}


def adapter():
    """The `Accumulation` class of Keras's backend, which `accumulate` and `wrap`
    attach to a model."""
    import keras

    return importlib.import_module(ADAPTERS[keras.backend.backend()]).Accumulation


def require_supported_backend(name: str | None = None) -> str:
    """Returns Keras's backend, or raises an ImportError naming the supported backends
    (and, for a public name that runs on some of them only, saying where it runs).

    Checked before gradaccum's modules are imported: they build on the backend's
    training loop, and under another backend they would fail with an error that does
    not say why.
    """
    backend = _tf.keras_backend()
    if backend not in ADAPTERS:
        supported = ", ".join(repr(b) for b in ADAPTERS)
        choices = " or ".join(f"KERAS_BACKEND={b}" for b in ADAPTERS)
        raise ImportError(
            f"gradaccum supports Keras's backends {supported}. Received: "
            f"keras.backend.backend()={backend!r}. Set the environment variable "
            f"{choices} before Keras is imported."
        )
    if backend == "tensorflow":
        _tf.require_tensorflow()
    where = None if name is None else ONLY_ON.get(name)
    if where is not None and backend not in where:
        runs = " or ".join(NAMES[b] for b in where)
        raise ImportError(
            f"gradaccum.{name} runs on Keras's {runs} backend. Received: "
            f"keras.backend.backend()={backend!r}. On {NAMES[backend]}, use "
            "gradaccum.accumulate"
            "(model, steps=...) with the model's own fit (or gradaccum.wrap), or set "
            f"KERAS_BACKEND={where[0]} before Keras is imported."
        )
    return backend
