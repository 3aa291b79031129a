"""The messages of what a window meets: loss terms whose normalizers are not
proportional (`INEXACT`), a model without a compiled loss, and the errors a step
records or raises (`error_message`)."""

from __future__ import annotations

import warnings

from gradaccum.core import screening
from gradaccum.core.state import ERRORS
from gradaccum.core.validation import NEGATIVE_WEIGHT
from gradaccum.core.window import SCHEDULE_RULE

# What `fit` warns of loss terms whose normalizers are not proportional across a
# window, and `audit` names.
INEXACT = (
    "weighting='exact' is approximate for this model: its loss terms have "
    "normalizers that are not proportional across the micro-batches of a "
    "window (e.g. outputs with their own masks), so one weight per "
    "micro-batch cannot reproduce the large-batch loss. Use equal "
    "micro-batches, or a `weighting` callable for your normalizer."
)


def warn_inexact(stacklevel: int = 3) -> None:
    """Several loss terms whose normalizers are not proportional across a window."""
    warnings.warn(INEXACT, stacklevel=stacklevel)


def warn_no_compiled_loss(stacklevel: int = 4) -> None:
    warnings.warn(
        "weighting='exact' found no compiled loss (only `add_loss` terms): "
        "micro-batches are weighted by their size.",
        stacklevel=stacklevel,
    )


def error_message(code, micro_batch=None, at=None, value=None) -> str:
    """The message of an error a step met: `code` (a name or a number of `ERRORS`),
    the micro-batch's number among all (from 1), where it happened (its place in
    its window, or the update index for a schedule) and the value at fault."""
    if not isinstance(code, str):
        code = next(name for name, number in ERRORS.items() if number == code)
    if code == "nonfinite":
        return screening.raise_message(micro_batch, at)
    if code == "negative_weight":
        return (f"{NEGATIVE_WEIGHT}. Received: a negative or nan weight for micro-batch "
                f"{at} of its window (it was accumulated with weight 0).")
    if code == "miscount":
        return ("gradaccum counted on the host that a micro-batch closed no window, "
                f"and the training state's window held {at} micro-batches with it, "
                "due: the state was changed during the epoch outside `fit`'s step, and "
                "windows closed later than their length. Please report this with the "
                "fit's callbacks.")
    received = "a value < 1" if value is None else str(value)
    return f"{SCHEDULE_RULE} Received: {received} for update_index={at}"
