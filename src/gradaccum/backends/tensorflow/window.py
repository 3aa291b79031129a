"""The window's rule on TensorFlow: a `steps` schedule's callable runs as a
`tf.function` (AutoGraph on), so Python `if`/`while` on the update index work as
TensorFlow control flow in the traced step. The rule itself (`WindowSpec`) and what
happens at the end of the data (`partial`) are `gradaccum.core`'s."""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.window import PARTIALS, WindowSpec, checked_schedule_value

__all__ = ["PARTIALS", "WindowRule"]


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

    def prepare(self) -> None:
        self._schedule = (
            self.steps if hasattr(self.steps, "get_concrete_function")
            else tf.function(self.steps, autograph=True)
        )
        # Tried once now on a symbolic update index (update 0 is tried next).
        with tf.init_scope():
            try:
                self._schedule.get_concrete_function(tf.TensorSpec((), tf.int64))
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
        if callable(self.steps):
            return tf.cast(checked_schedule_value(self._schedule(update_index)), tf.int64)
        # An integer or pairs: the core's lookup, in the accumulator's int64.
        return tf.cast(super().length(update_index), tf.int64)

    def first_length(self) -> int:
        with tf.init_scope():
            return int(self.length(tf.constant(0, tf.int64)))
