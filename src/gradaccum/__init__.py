"""gradaccum: exact gradient accumulation for Keras 3, on TensorFlow, JAX and PyTorch.

Train with an effective batch of k x b at the memory of b: gradients of k
micro-batches are combined, weighted by each micro-batch's loss normalizer, into one
optimizer update that equals the update on the whole window.

The public API is exported here; TensorFlow is imported when it is first used, so the
command line checks its arguments without waiting for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradaccum import _backend

__version__ = "0.1.0"

_EXPORTS: dict[str, str | dict[str, str]] = {
    # One per backend (Keras's decides).
    "GradientAccumulator": {
        "tensorflow": "gradaccum.backends.tensorflow.accumulator",
        "jax": "gradaccum.backends.jax.accumulator",
        "torch": "gradaccum.backends.torch.accumulator",
    },
    "AccumulatingModel": "gradaccum.keras_model",
    "BatchNormalization": "gradaccum.backends.tensorflow.batch_norm",
    "convert_batch_normalization": "gradaccum.backends.tensorflow.batch_norm",
    "CountingCrossDeviceOps": "gradaccum.backends.tensorflow.communication",
    "wrap": "gradaccum.keras_model",
    "accumulate": "gradaccum.attach",
    "disable": "gradaccum.attach",
    "end_of_data": "gradaccum.attach",
    "audit": "gradaccum.auditing",
    "AuditReport": "gradaccum.auditing",
    "Privacy": "gradaccum.core.privacy",
    "NoiseScaleSchedule": "gradaccum.core.noise_scale",
    "privacy_spent": "gradaccum.privacy",
    "load_model": "gradaccum.model_file",
}

__all__ = [
    "AccumulatingModel",
    "AuditReport",
    "BatchNormalization",
    "CountingCrossDeviceOps",
    "GradientAccumulator",
    "NoiseScaleSchedule",
    "Privacy",
    "__version__",
    "accumulate",
    "audit",
    "convert_batch_normalization",
    "disable",
    "end_of_data",
    "load_model",
    "privacy_spent",
    "wrap",
]

if TYPE_CHECKING:  # pragma: no cover
    from gradaccum.attach import accumulate, disable, end_of_data
    from gradaccum.auditing import AuditReport, audit
    from gradaccum.backends.tensorflow.accumulator import GradientAccumulator
    from gradaccum.backends.tensorflow.batch_norm import (
        BatchNormalization,
        convert_batch_normalization,
    )
    from gradaccum.backends.tensorflow.communication import CountingCrossDeviceOps
    from gradaccum.core.noise_scale import NoiseScaleSchedule
    from gradaccum.core.privacy import Privacy
    from gradaccum.keras_model import AccumulatingModel, wrap
    from gradaccum.model_file import load_model
    from gradaccum.privacy import privacy_spent


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        # Before the module: without TensorFlow, importing it (or Keras, whose default
        # backend is TensorFlow) fails with an error that does not say what to install;
        # under another backend than TensorFlow or JAX, or a TensorFlow-only name on
        # JAX, the error says what runs where.
        backend = _backend.require_supported_backend(name)
        module = _EXPORTS[name]
        if isinstance(module, dict):
            module = module[backend]
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
