"""The non-finite policy, for every backend: a name or the user's callable, as
optax's `should_skip_update_fn`.

- `"skip"` (default): a micro-batch whose gradient holds an inf or a nan is dropped
  with its weight, counted, and warned about once;
- `"raise"`: such a micro-batch stops training with an error naming it;
- `"apply"`: every micro-batch is accumulated as it is (Keras's behaviour);
- a callable `gradients -> bool` (a Python or tensor boolean): True skips the
  micro-batch, as `"skip"` does, without a warning.

`gradaccum.core.transitions.screen` applies it; here are the user callable's call and
the policy's words (`"raise"`'s error, `"skip"`'s warning).
"""

from __future__ import annotations

import warnings

from gradaccum.core.validation import check_callable_result

# The error of nonfinite="raise": its words around the micro-batch's number and its
# place in the window.
RAISE_WORDS = (
    "gradaccum: a gradient is not finite (inf or nan) in micro-batch",
    "(counted from 1; the micro-batch",
    "of its window): nonfinite=raise stops here. Check the data and the loss of "
    "that micro-batch, or use nonfinite=skip to drop it.",
)


def raise_message(micro_batch: int, position: int) -> str:
    return f"{RAISE_WORDS[0]} {micro_batch} {RAISE_WORDS[1]} {position} {RAISE_WORDS[2]}"


def skipped_message(count: int) -> str:
    """What `fit` warns of skipped micro-batches, and `audit` names."""
    return (
        f"gradaccum skipped {count} micro-batch(es) whose gradient is not finite "
        "(inf or nan): each is dropped with its weight and counted in `skipped` "
        "(in fit's logs too; nonfinite='skip'). Pass nonfinite='raise' to stop at "
        "the first, or nonfinite='apply' for Keras's behaviour."
    )


def warn_skipped(count: int = 1, stacklevel: int = 4) -> None:
    """The one warning of nonfinite="skip" (shown once per accumulator)."""
    warnings.warn(skipped_message(count), stacklevel=stacklevel)


def user_skip(nonfinite, gradients):
    """Calls a user's `nonfinite` callable on the micro-batch's gradients and checks
    that it gives a boolean scalar (True: skip)."""
    return check_callable_result(
        nonfinite(list(gradients)),
        "nonfinite",
        kind="a boolean (True: skip the micro-batch)",
        scalar="a scalar boolean",
        accepts=lambda dtype: dtype == "bool",
    )
