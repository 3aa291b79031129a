"""The window policy, in one home: when a window closes and what happens to a
window the data ends in the middle of (`partial`).

- A window closes after `steps` micro-batches (skipped ones included); `steps` may
  be a schedule by update index (`WindowRule`), read when the window opens.
- Or, with a weight budget, at the first micro-batch after which the window's total
  weight reaches `weight_per_update` (skipped micro-batches add no weight).
- At the end of the data (the last micro-batch of an epoch, or the end of `fit`):
  `"flush"` applies what is there, normalized by its own weights; `"carry"` keeps it
  open into the next epoch; `"drop"` discards it.

`close_if_due` runs inside a training step (graph-safe); `close_at_end` runs eagerly
(or as a `tf.function`) after the data ran out when the step could not know it.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.window import (  # noqa: F401 (PARTIALS re-exported)
    PARTIALS,
    SCHEDULE_RULE,
    WindowSpec,
    checked_schedule_value,
)

_SCHEDULE_RULE = SCHEDULE_RULE


class WindowRule(WindowSpec):
    """When the open window is due: after `steps` micro-batches, `steps` an integer
    or a schedule by update index (a callable `update_index -> int`, or sorted
    `(from_update, k)` pairs), or once its total weight reaches `weight_per_update`.

    A callable runs inside the traced training step: it is wrapped in a
    `tf.function` (AutoGraph on), so Python `if`/`while` on the update index work as
    TensorFlow control flow; Python side effects happen when it is traced, not
    per call.

    Args:
        steps: as given to `GradientAccumulator` (checked here), or None.
        weight_per_update: a weight budget > 0, or None. Not with `steps`.
    """

    def __init__(self, steps=None, weight_per_update=None):
        super().__init__(steps, weight_per_update)
        self._schedule = None
        if callable(self.steps):
            self._schedule = (
                self.steps if hasattr(self.steps, "get_concrete_function")
                else tf.function(self.steps, autograph=True)
            )
            # Called once now (update 0): a wrong type or a first window of 0 is
            # refused before a training step is traced.
            with tf.init_scope():
                try:
                    self._checked_length(tf.constant(0, tf.int64))
                except tf.errors.OperatorNotAllowedInGraphError as error:
                    raise ValueError(
                        "The `steps` callable must run in a traced step: written with "
                        "TensorFlow ops, or with Python control flow that AutoGraph can "
                        "convert (its source in a file or a notebook). Received: a "
                        f"callable that failed on a symbolic update index: {error}"
                    ) from error

    def length(self, update_index):
        """The length (int64 tensor) of the window that makes update `update_index`
        (counted from 0): the schedule's value there."""
        update_index = tf.cast(update_index, tf.int64)
        if self._schedule is not None:
            return self._checked_length(update_index)
        # An integer or pairs: the core's lookup, in the accumulator's int64.
        return tf.cast(super().length(update_index), tf.int64)

    def _checked_length(self, update_index):
        value = tf.cast(checked_schedule_value(self._schedule(update_index)), tf.int64)
        if tf.executing_eagerly():
            if int(value) < 1:
                raise ValueError(
                    f"{_SCHEDULE_RULE} Received: {int(value)} for "
                    f"update_index={int(update_index)}"
                )
            return value
        check = tf.debugging.Assert(
            value >= 1,
            [f"{_SCHEDULE_RULE} Received:", value, "for update_index=", update_index],
        )
        with tf.control_dependencies([check]):
            # XLA compiles the assertion away: there a length below 1 acts as 1.
            return tf.maximum(tf.identity(value), 1)


def _drop(accumulator):
    accumulator.reset()
    return tf.constant(True)


def close_if_due(accumulator, optimizer, partial: str, end_of_data) -> None:
    """Applies a full window (as the accumulator's `WindowRule` says); at the end of
    the data, treats a partial one as `partial` says."""
    full = accumulator.window_due()
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
