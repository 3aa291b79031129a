"""The window policy, in one home: when a window closes and what happens to a
window the data ends in the middle of (`partial`).

- A window closes after `steps` micro-batches (skipped ones included).
- At the end of the data (the last micro-batch of an epoch, or the end of `fit`):
  `"flush"` applies what is there, normalized by its own weights; `"carry"` keeps it
  open into the next epoch; `"drop"` discards it.

`close_if_due` runs inside a training step (graph-safe); `close_at_end` runs eagerly
(or as a `tf.function`) after the data ran out when the step could not know it.
"""

from __future__ import annotations

import tensorflow as tf

PARTIALS = ("flush", "carry", "drop")


def _drop(accumulator):
    accumulator.reset()
    return tf.constant(True)


def close_if_due(accumulator, optimizer, steps: int, partial: str, end_of_data) -> None:
    """Applies a full window; at the end of the data, treats a partial one as
    `partial` says."""
    full = accumulator.window_length() >= steps
    if partial == "flush":
        accumulator.apply_if(optimizer, tf.logical_or(full, end_of_data))
        return
    accumulator.apply_if(optimizer, full)
    if partial == "drop":
        tf.cond(end_of_data, lambda: _drop(accumulator), lambda: tf.constant(False))


def close_at_end(accumulator, optimizer, partial: str):
    """The data ended: the open window is flushed or dropped (idempotent), or kept
    with `"carry"`. Returns whether an update happened or a window was dropped."""
    if partial == "flush":
        return accumulator.apply(optimizer)
    if partial == "drop":
        # A window of only skipped micro-batches is closed too.
        return tf.cond(
            accumulator.window_length() > 0,
            lambda: _drop(accumulator),
            lambda: tf.constant(False),
        )
    return tf.constant(False)
