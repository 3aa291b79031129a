"""The non-finite policies' words, for every backend: `nonfinite="raise"`'s error and
`"skip"`'s warning (the policies themselves are checked in `_validation`)."""

from __future__ import annotations

import warnings

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


def warn_skipped(count: int = 1, stacklevel: int = 4) -> None:
    """The one warning of nonfinite="skip" (shown once per accumulator)."""
    warnings.warn(
        f"gradaccum skipped {count} micro-batch(es) whose gradient is not finite "
        "(inf or nan): each is dropped with its weight and counted in `skipped` "
        "(in fit's logs too; nonfinite='skip'; this warning is shown once). Pass "
        "nonfinite='raise' to stop at the first, or nonfinite='apply' for Keras's "
        "behaviour.",
        stacklevel=stacklevel,
    )
