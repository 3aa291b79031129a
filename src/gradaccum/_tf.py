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
BACKENDS = ("tensorflow",)


def require_supported_backend() -> None:
    """Raises an ImportError naming the supported backends when Keras runs on another.

    Checked before gradaccum's modules are imported: they build on TensorFlow's
    training loop, and under another backend they would fail with an error that does
    not say why.
    """
    import keras

    backend = keras.backend.backend()
    if backend not in BACKENDS:
        supported = ", ".join(repr(name) for name in BACKENDS)
        raise ImportError(
            f"gradaccum supports Keras's backends {supported}. Received: "
            f"keras.backend.backend()={backend!r}. Set the environment variable "
            "KERAS_BACKEND=tensorflow before Keras is imported."
        )
