"""Which adapter runs: Keras's backend decides, once per process."""

from __future__ import annotations

import importlib

import keras

# Keras's backends gradaccum trains on, and the module of each one's adapter.
ADAPTERS = {
    "tensorflow": "gradaccum.backends.tensorflow.fit",
    "jax": "gradaccum.backends.jax.fit",
}


def current():
    """The adapter module of Keras's backend: `Options`, `Accumulation` and
    `check_model` for the doors (`accumulate`, `wrap`)."""
    return importlib.import_module(ADAPTERS[keras.backend.backend()])
