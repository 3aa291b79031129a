"""A clear message when TensorFlow is missing (it is an install-time choice): which
extra installs it."""

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
