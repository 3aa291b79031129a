"""The few private Keras pieces gradaccum relies on, in one place.

Exact weighting must divide by the same normalizer as Keras's loss reduction, so it
reuses Keras's own masking and rank-matching helpers rather than re-deriving them.
"""

from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses.loss import (
    apply_mask,
    squeeze_or_expand_to_same_rank,
    unscale_loss_for_distribution,
)
from keras.src.losses.losses import LossFunctionWrapper


def count_compiled_losses(compile_loss) -> int:
    """How many loss terms a model's compiled loss (Keras's CompileLoss) holds."""
    if compile_loss is None:
        return 0
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is None:
        import tensorflow as tf

        flat = [loss for loss in tf.nest.flatten(compile_loss._user_loss) if loss is not None]
    return len(flat)


__all__ = [
    "LossFunctionWrapper",
    "count_compiled_losses",
    "apply_mask",
    "get_keras_mask",
    "squeeze_or_expand_to_same_rank",
    "unscale_loss_for_distribution",
]
