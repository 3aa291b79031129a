"""gradaccum: exact gradient accumulation for TensorFlow 2 / Keras 3.

Train with an effective batch of k x b at the memory of b: gradients of k
micro-batches are combined, weighted by each micro-batch's loss normalizer, into one
optimizer update that equals the update on the whole window.
"""

from gradaccum._tf import require_tensorflow as _require_tensorflow

_require_tensorflow()

from gradaccum.accumulator import GradientAccumulator  # noqa: E402
from gradaccum.keras_model import AccumulatingModel, wrap  # noqa: E402

__version__ = "0.1.0"

__all__ = ["AccumulatingModel", "GradientAccumulator", "__version__", "wrap"]
