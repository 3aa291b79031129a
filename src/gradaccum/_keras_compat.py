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

__all__ = [
    "LossFunctionWrapper",
    "apply_mask",
    "get_keras_mask",
    "squeeze_or_expand_to_same_rank",
    "unscale_loss_for_distribution",
]
