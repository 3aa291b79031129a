"""A clear message when TensorFlow is missing (it is an install-time choice), or when
Keras runs on a backend gradaccum does not support."""

from __future__ import annotations

import importlib.util

REQUIREMENT = "TensorFlow >= 2.16"
# The extras that choose a TensorFlow wheel, and what each one installs.
EXTRAS = {
    "cpu": "CPU-only TensorFlow (smaller)",
    "gpu": "TensorFlow with CUDA (Linux GPUs)",
    "tf": "the standard `tensorflow` wheel",
}


def _install_line(extra: str, what: str) -> str:
    command = f"pip install 'gradaccum[{extra}]'"
    return f"  {command:<31}# {what}"


MESSAGE = f"gradaccum needs {REQUIREMENT}. Install it with one of:\n" + "\n".join(
    _install_line(extra, what) for extra, what in EXTRAS.items()
)


def tensorflow_installed() -> bool:
    """Whether `tensorflow` can be found, without the seconds its import takes."""
    return importlib.util.find_spec("tensorflow") is not None


def require_tensorflow() -> None:
    """Imports TensorFlow, or raises an ImportError that says which extra to install."""
    try:
        import tensorflow  # noqa: F401
    except ImportError as error:
        raise ImportError(MESSAGE) from error


# Keras's backends gradaccum trains on.
BACKENDS = ("tensorflow", "jax")
# What runs on TensorFlow only (a custom tf loop, tf.distribute, batch norm's pooled
# statistics): on JAX these names raise an ImportError that says so.
TENSORFLOW_ONLY = (
    "BatchNormalization",
    "CountingCrossDeviceOps",
    "GradientAccumulator",
    "convert_batch_normalization",
)


def keras_backend() -> str:
    """Keras's backend, importing Keras (its default backend needs TensorFlow: without
    it, the message says which extra to install)."""
    try:
        import keras
    except ImportError as error:
        if not tensorflow_installed():
            raise ImportError(MESSAGE) from error
        raise
    return keras.backend.backend()


def require_supported_backend(name: str | None = None) -> str:
    """Returns Keras's backend, or raises an ImportError naming the supported backends
    (and, for a name of `TENSORFLOW_ONLY` on JAX, saying that it runs on TensorFlow).

    Checked before gradaccum's modules are imported: they build on the backend's
    training loop, and under another backend they would fail with an error that does
    not say why.
    """
    backend = keras_backend()
    if backend not in BACKENDS:
        supported = ", ".join(repr(b) for b in BACKENDS)
        raise ImportError(
            f"gradaccum supports Keras's backends {supported}. Received: "
            f"keras.backend.backend()={backend!r}. Set the environment variable "
            "KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before Keras is imported."
        )
    if backend == "tensorflow":
        require_tensorflow()
    elif name in TENSORFLOW_ONLY:
        raise ImportError(
            f"gradaccum.{name} runs on Keras's TensorFlow backend. Received: "
            f"keras.backend.backend()={backend!r}. On JAX, use gradaccum.accumulate"
            "(model, steps=...) with the model's own fit (or gradaccum.wrap), or set "
            "KERAS_BACKEND=tensorflow before Keras is imported."
        )
    return backend
