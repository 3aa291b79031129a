"""When a window closes: the rule, for every backend.

- A window closes after `steps` micro-batches (skipped ones included); `steps` may
  be a schedule by update index, read when the window opens.
- Or, with a weight budget, at the first micro-batch after which the window's total
  weight reaches `weight_per_update` (skipped micro-batches add no weight).
- At the end of the data (the last micro-batch of an epoch, or the end of `fit`),
  `partial` decides: `"flush"` applies what is there, normalized by its own weights;
  `"carry"` keeps it open into the next epoch; `"drop"` discards it.

`WindowSpec` holds the checked rule and computes the length of a window from the
update index with `keras.ops`; a backend subclasses it to run a schedule's callable
its own way (TensorFlow through AutoGraph, JAX traced as it is). The transitions
that apply it are `gradaccum.core.transitions`.
"""

from __future__ import annotations

import keras

from gradaccum.core.validation import check_callable_result, check_window_rule, is_integer_dtype

PARTIALS = ("flush", "carry", "drop")

SCHEDULE_RULE = "The `steps` callable must return an integer >= 1."


class WindowSpec:
    """When the open window is due: after `steps` micro-batches (an integer, sorted
    `(from_update, k)` pairs, or a callable `update_index -> int`), or once its total
    weight reaches `weight_per_update`.

    Args:
        steps: as given to `accumulate` (checked here), or None.
        weight_per_update: a weight budget > 0, or None. Not with `steps`.
    """

    def __init__(self, steps=None, weight_per_update=None):
        self.steps, self.weight_per_update = check_window_rule(steps, weight_per_update)
        if callable(self.steps):
            # Ready to run in the backend's traced step, then tried on update 0: a
            # wrong type or a first window below 1 is refused before a step runs.
            self.prepare()
            first = self.first_length()
            if first < 1:
                raise ValueError(f"{SCHEDULE_RULE} Received: {first} for update_index=0")

    def prepare(self) -> None:
        """Makes a schedule's callable ready for the backend's traced step (and
        refuses one that cannot run there): a backend's rule overrides it."""

    def first_length(self) -> int:
        """The schedule's value at update 0, as a Python int."""
        return int(self.length(0))

    @property
    def constant(self) -> int | None:
        """The window's length when it never changes (an integer `steps`)."""
        return self.steps if isinstance(self.steps, int) else None

    @property
    def scheduled(self) -> bool:
        """Whether the window's length depends on the update index."""
        return self.steps is not None and self.constant is None

    def length(self, update_index):
        """The length (an int32 tensor) of the window that makes update
        `update_index` (counted from 0); 0 with a weight budget (no length)."""
        ops = keras.ops
        if self.steps is None:
            return ops.convert_to_tensor(0, "int32")
        if callable(self.steps):
            return self.callable_length(update_index)
        if self.constant is not None:
            return ops.convert_to_tensor(self.constant, "int32")
        starts = ops.convert_to_tensor([start for start, _ in self.steps], "int32")
        lengths = ops.convert_to_tensor([k for _, k in self.steps], "int32")
        index = ops.reshape(ops.cast(update_index, "int32"), (1,))
        # The last pair starting at or before the update (the first starts at 0).
        position = ops.searchsorted(starts, index, side="right")[0] - 1
        return ops.take(lengths, position)

    def callable_length(self, update_index):
        """The schedule callable's value at `update_index`, checked for its type
        (a backend checks the value >= 1 its own way)."""
        return keras.ops.cast(checked_schedule_value(self.steps(update_index)), "int32")


def checked_schedule_value(value):
    """A `steps` callable's value, refused unless it is an integer scalar (both
    adapters call the callable their own way, then check its value here)."""
    return check_callable_result(
        value,
        "steps",
        kind="an integer >= 1",
        scalar="a scalar integer >= 1",
        accepts=is_integer_dtype,
    )
