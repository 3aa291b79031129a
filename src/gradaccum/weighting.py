"""How a micro-batch's weight `w_i` is found.

- `"exact"`: `w_i = n_i`, the normalizer Keras divides the micro-batch's summed loss
  by (number of loss elements, unmasked elements, or the sum of sample weights under
  `mean_with_sample_weight`). The combined gradient is then the gradient of the
  compiled loss on the whole window.
- `"uniform"`: `w_i = 1`, the plain mean (exact only for equal normalizers).
- a callable `(x, y, sample_weight) -> weight`.

Exact weighting learns `n_i` by wrapping each compiled loss in `_NormalizedLoss`,
which computes the loss exactly as Keras does and records its normalizer.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from gradaccum import _keras_compat as kc
from gradaccum._validation import check_callable_result

WEIGHTINGS = ("exact", "uniform")
_EXACT_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def check_weighting(weighting):
    """Returns `weighting` if it is a known name or a callable, else raises."""
    if callable(weighting) or (isinstance(weighting, str) and weighting in WEIGHTINGS):
        return weighting
    raise ValueError(
        "`weighting` must be one of 'exact', 'uniform' or a callable "
        f"(x, y, sample_weight) -> weight. Received: weighting={weighting!r}"
    )


def loss_normalizer(losses, sample_weight, mask, reduction, dtype="float32"):
    """The divisor `n` of Keras's reduction: the loss equals `sum(weighted) / n`.

    Args:
        losses: the unreduced loss values (`Loss.call` output).
        sample_weight: the sample weights passed to the loss, or None.
        mask: the Keras mask of the predictions/losses, or None.
        reduction: the loss's reduction.
        dtype: the loss's compute dtype.

    Returns:
        A float32 scalar tensor.
    """
    values = tf.convert_to_tensor(losses, dtype=dtype)
    if sample_weight is not None:
        sample_weight = tf.cast(sample_weight, dtype)
    if mask is not None:
        mask = tf.cast(mask, dtype)
    combined = kc.apply_mask(sample_weight, mask, dtype=values.dtype, reduction=reduction)
    if combined is not None:
        values, combined = kc.squeeze_or_expand_to_same_rank(values, combined)
        weighted_shape = tf.broadcast_dynamic_shape(tf.shape(values), tf.shape(combined))
    else:
        weighted_shape = tf.shape(values)
    size = tf.cast(tf.reduce_prod(weighted_shape), tf.float32)
    if reduction == "mean_with_sample_weight":
        if combined is None:
            return size
        return tf.cast(tf.reduce_sum(combined), tf.float32)
    if mask is None:
        return size
    # Keras scales unmasked entries by total/valid and divides by the size:
    # loss = sum(unmasked) * total / (valid * size), so n = valid * size / total.
    total = tf.cast(tf.size(mask), tf.float32)
    valid = tf.reduce_sum(tf.cast(tf.cast(mask, tf.bool), tf.float32))
    return tf.math.divide_no_nan(valid * size, total)


class NormalizerLog:
    """Collects the normalizers recorded while one loss is computed."""

    def __init__(self):
        self.values: list = []

    def take(self) -> list:
        values, self.values = self.values, []
        return values


@keras.saving.register_keras_serializable(package="gradaccum")
class _NormalizedLoss(keras.losses.Loss):
    """Computes a Keras loss unchanged and records its normalizer `n_i`."""

    def __init__(self, loss, log: NormalizerLog | None = None):
        loss = _as_loss_object(loss)
        if loss.reduction not in _EXACT_REDUCTIONS:
            raise ValueError(
                "weighting='exact' needs losses that divide by a normalizer "
                f"(reduction one of {', '.join(repr(r) for r in _EXACT_REDUCTIONS)}). "
                f"Received: loss '{loss.name}' with reduction={loss.reduction!r}. For "
                "a summed loss, wrap with reduction='sum'; else use "
                "weighting='uniform' or a callable."
            )
        super().__init__(name=loss.name, reduction=loss.reduction, dtype=loss.dtype)
        self.loss = loss
        self.log = log if log is not None else NormalizerLog()
        self._last = None
        self._warned_scalar = False

    def call(self, y_true, y_pred):
        self._last = self.loss.call(y_true, y_pred)
        return self._last

    def __call__(self, y_true, y_pred, sample_weight=None):
        in_mask = kc.get_keras_mask(y_pred)
        value = super().__call__(y_true, y_pred, sample_weight)
        losses, self._last = self._last, None
        out_mask = kc.get_keras_mask(losses)
        if in_mask is not None and out_mask is not None:
            mask = in_mask & out_mask
        else:
            mask = in_mask if in_mask is not None else out_mask
        if tuple(losses.shape) == ():
            # The loss function reduced itself; assume a mean over the batch.
            self._warn_scalar()
            first = tf.nest.flatten(y_pred)[0]
            n = tf.cast(tf.shape(first)[0], tf.float32)
        else:
            n = loss_normalizer(losses, sample_weight, mask, self.reduction, self.dtype)
        self.log.values.append(n)
        return value

    def _warn_scalar(self):
        if not self._warned_scalar:
            self._warned_scalar = True
            warnings.warn(
                f"Loss '{self.name}' returns a scalar, so its normalizer is unknown: "
                "weighting='exact' assumes it is a mean over the batch and weighs "
                "micro-batches by their size. Return per-sample losses to be exact.",
                stacklevel=3,
            )

    def get_config(self):
        return {"loss": keras.saving.serialize_keras_object(self.loss)}

    @classmethod
    def from_config(cls, config):
        # Deserializes to the plain loss: `wrap` re-adds the recording at compile.
        return keras.saving.deserialize_keras_object(config["loss"])


def _as_loss_object(loss) -> keras.losses.Loss:
    obj = keras.losses.get(loss)
    if isinstance(obj, keras.losses.Loss):
        if type(obj).__call__ is not keras.losses.Loss.__call__:
            raise ValueError(
                "weighting='exact' needs a loss whose reduction is Keras's own "
                f"(`Loss.call` + reduction). Received: loss '{obj.name}' that "
                "overrides `__call__`. Use weighting='uniform' or a callable."
            )
        return obj
    name = loss if isinstance(loss, str) else getattr(obj, "__name__", "loss")
    return kc.LossFunctionWrapper(obj, name=name)


def record_normalizers(loss, log: NormalizerLog):
    """Wraps every loss in a (nested) compile `loss` argument to record `n_i`."""
    if loss is None:
        return None
    if isinstance(loss, dict):
        return {key: record_normalizers(value, log) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(record_normalizers(value, log) for value in loss)
    if isinstance(loss, _NormalizedLoss):
        loss = loss.loss
    return _NormalizedLoss(loss, log)


def callable_weight(fn, x, y, sample_weight):
    """Calls a user weighting function and checks that it gives a scalar >= 0."""
    weight = check_callable_result(
        fn(x, y, sample_weight),
        "weighting",
        kind="a number",
        scalar="a scalar weight",
        accepts=lambda dtype: dtype.is_floating or dtype.is_integer,
    )
    weight = tf.cast(weight, tf.float32)
    check = tf.debugging.assert_greater_equal(
        weight,
        0.0,
        message="The `weighting` callable must return a weight >= 0",
    )
    with tf.control_dependencies([check] if check is not None else []):
        return tf.identity(weight)
