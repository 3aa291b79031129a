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

import math
import warnings

import keras

from gradaccum import _keras_common as kc
from gradaccum.core.validation import (  # noqa: F401 (re-exported)
    WEIGHTINGS,
    check_callable_result,
    check_weighting,
    is_number_dtype,
)

_EXACT_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def loss_normalizer(losses, sample_weight, mask, reduction, dtype="float32"):
    """The divisor `n` of Keras's reduction: the loss equals `sum(weighted) / n`.

    Written with `keras.ops`: the same function runs inside TensorFlow's and JAX's
    training steps.

    Args:
        losses: the unreduced loss values (`Loss.call` output).
        sample_weight: the sample weights passed to the loss, or None.
        mask: the Keras mask of the predictions/losses, or None.
        reduction: the loss's reduction.
        dtype: the loss's compute dtype.

    Returns:
        A float32 scalar tensor.
    """
    ops = keras.ops
    values = ops.convert_to_tensor(losses, dtype=dtype)
    if sample_weight is not None:
        # A copy: Keras's `apply_mask` multiplies it in place on PyTorch, and the
        # loss Keras computed from it is still to be differentiated.
        sample_weight = ops.copy(ops.cast(sample_weight, dtype))
    if mask is not None:
        mask = ops.cast(mask, dtype)
    combined = kc.apply_mask(sample_weight, mask, dtype=values.dtype, reduction=reduction)
    if combined is not None:
        values, combined = kc.squeeze_or_expand_to_same_rank(values, combined)
        weighted = values * combined
    else:
        weighted = values
    size = ops.cast(ops.size(weighted), "float32")
    if reduction == "mean_with_sample_weight":
        if combined is None:
            return size
        return ops.cast(ops.sum(combined), "float32")
    if mask is None:
        return size
    # Keras scales unmasked entries by total/valid and divides by the size:
    # loss = sum(unmasked) * total / (valid * size), so n = valid * size / total.
    total = ops.cast(ops.size(mask), "float32")
    valid = ops.sum(ops.cast(ops.cast(mask, "bool"), "float32"))
    return ops.divide_no_nan(valid * size, total)


class NormalizerLog:
    """Collects the normalizers recorded while one loss is computed."""

    def __init__(self) -> None:
        self.values: list = []
        self.last: list = []

    def take(self) -> list:
        values, self.values = self.values, []
        return values

    def start(self) -> None:
        """A micro-batch of a model's own step starts: nothing recorded yet."""
        self.values, self.last = [], []

    def since_last_call(self) -> list:
        """For one optimizer call of a model's own step: the normalizers recorded
        since the previous call, or the previous call's where none was (the step
        computed its loss once for several optimizers)."""
        values = self.take()
        if values:
            self.last = values
        return self.last


@keras.saving.register_keras_serializable(package="gradaccum")
class _NormalizedLoss(keras.losses.Loss):
    """Computes a Keras loss unchanged and records its normalizer `n_i`."""

    def __init__(self, loss, log: NormalizerLog | None = None, summed: bool = False):
        loss = _as_loss_object(loss)
        check_reduction(loss, summed)
        super().__init__(name=loss.name, reduction=loss.reduction, dtype=loss.dtype)
        self.loss = loss
        # Under gradaccum's reduction='sum', a summed loss's weight (the window's in
        # the logs, a `weight_per_update` budget) counts its elements as a mean's
        # normalizer would.
        self._counted = "sum_over_batch_size" if loss.reduction == "sum" else None
        self.log = log if log is not None else NormalizerLog()
        self._last = None
        self._warned_scalar = False

    def call(self, y_true, y_pred):
        losses = self.loss.call(y_true, y_pred)
        # The mask is read when Keras reads it: on JAX a mask is kept by the tensor's
        # id, which a later tensor may reuse.
        self._last = (losses, kc.get_keras_mask(losses))
        return losses

    def __call__(self, y_true, y_pred, sample_weight=None):
        in_mask = kc.get_keras_mask(y_pred)
        value = super().__call__(y_true, y_pred, sample_weight)
        (losses, out_mask), self._last = self._last, None
        if in_mask is not None and out_mask is not None:
            mask = in_mask & out_mask
        else:
            mask = in_mask if in_mask is not None else out_mask
        if tuple(losses.shape) == ():
            # The loss function reduced itself; assume a mean over the batch.
            self._warn_scalar()
            first = keras.tree.flatten(y_pred)[0]
            n = keras.ops.cast(keras.ops.shape(first)[0], "float32")
        else:
            n = loss_normalizer(losses, sample_weight, mask,
                                self._counted or self.reduction, self.dtype)
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


def check_reduction(loss, summed: bool) -> None:
    """Refuses, with what to pass, a loss whose reduction weighting='exact' cannot
    weigh under gradaccum's `reduction` (`summed`: reduction='sum')."""
    reduction = loss.reduction
    if reduction in _EXACT_REDUCTIONS or (summed and reduction == "sum"):
        return
    received = f"Received: loss '{loss.name}' with reduction={reduction!r}"
    if reduction in (None, "none"):
        raise ValueError(
            "Keras trains on a loss reduced to a scalar, and weighting='exact' weighs "
            f"it by its normalizer. {received}, which returns each sample's loss. "
            "Give the loss reduction='sum_over_batch_size' (a mean: weighted "
            "exactly), or reduction='sum' and pass reduction='sum' to gradaccum."
        )
    # Keras's other reduction: "sum".
    raise ValueError(
        "weighting='exact' with reduction='mean' (gradaccum's) needs losses that "
        "divide by a normalizer (reduction one of "
        f"{', '.join(repr(r) for r in _EXACT_REDUCTIONS)}). {received}. For a loss "
        "summed over the batch, pass reduction='sum' to gradaccum: the window's "
        "gradients are then summed, which is the large batch's gradient of such a "
        "loss. Else give the loss reduction='sum_over_batch_size', or pass "
        "weighting='uniform' or a callable."
    )


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


def record_normalizers(loss, log: NormalizerLog, reduction: str = "mean"):
    """Wraps every loss in a (nested) compile `loss` argument to record `n_i`
    (`reduction`: gradaccum's, under which the losses are checked)."""
    if loss is None:
        return None
    if isinstance(loss, dict):
        return {key: record_normalizers(value, log, reduction) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(record_normalizers(value, log, reduction) for value in loss)
    if isinstance(loss, _NormalizedLoss):
        loss = loss.loss
    return _NormalizedLoss(loss, log, summed=reduction == "sum")


def uniform_message(sizes) -> str:
    """What `audit` names, and `fit` warns of, for weighting='uniform' over
    micro-batches of `sizes` samples."""
    return (
        "weighting='uniform' (micro-batches of "
        + ", ".join(str(n) for n in sizes)
        + " samples): each micro-batch counts the same, which is exact only where "
        "every micro-batch's loss normalizer (its samples, unmasked tokens or "
        "sample weights) is equal; weighting='exact' weighs them by their "
        "normalizers."
    )


def micro_batch_sizes(x, batch_size, validation_split=None, micro_batch_size=None):
    """The distinct sizes of the micro-batches `fit` cuts arrays `x` into, largest
    first (None: `x` is not arrays, or a split size is not a number)."""
    flat = keras.tree.flatten(x) if x is not None else []
    if not flat or not all(hasattr(t, "shape") and len(t.shape) for t in flat):
        return None
    samples = int(flat[0].shape[0])
    if validation_split:
        samples = int(math.ceil(samples * (1.0 - validation_split)))
    batch = batch_size or 32  # Keras's default
    batches = {min(batch, samples)} | ({samples % batch} if samples % batch else set())
    if micro_batch_size is not None:
        if not isinstance(micro_batch_size, int):
            return None
        batches = {part for b in batches
                   for part in ({min(micro_batch_size, b)}
                                | ({b % micro_batch_size} if b % micro_batch_size else set()))}
    return sorted(batches, reverse=True)
