"""When a window closes: the rule, for every backend.

- A window closes after `steps` micro-batches (skipped ones included); `steps` may
  be a schedule by update index, read when the window opens.
- Or, with a weight budget, at the first micro-batch after which the window's total
  weight reaches `weight_per_update` (skipped micro-batches add no weight).
- At the end of the data (the last micro-batch of an epoch, or the end of `fit`),
  `partial` decides: `"flush"` applies what is there, normalized by its own weights;
  `"carry"` keeps it open into the next epoch; `"drop"` discards it.

`WindowRule` holds the checked rule and computes the length of a window from the
update index with `keras.ops`, for every backend. The one thing a backend does its
own way is run a schedule's callable in its step (TensorFlow through AutoGraph, JAX
traced as it is, PyTorch on a Python int): its `ScheduleRunner`, which the rule is
given. The transitions that apply the rule are `gradaccum.core.transitions`.
"""

from __future__ import annotations

import keras

from gradaccum.core.noise_scale import NoiseScaleSchedule
from gradaccum.core.validation import check_callable_result, check_window_rule, is_integer_dtype

PARTIALS = ("flush", "carry", "drop")

SCHEDULE_RULE = "The `steps` callable must return an integer >= 1."


class ScheduleRunner:
    """How a backend's step runs a `steps` callable (`update_index -> int`). This base
    calls it as it is on the update index; each backend's `record.py` writes its own.
    """

    #: The dtype of a window's length where the backend's step counts in it.
    length_dtype = "int32"

    def prepare(self, steps):
        """`steps` made ready to run in the backend's step; raises a ValueError for a
        callable that cannot run there."""
        return steps

    def value(self, prepared, update_index):
        """The prepared callable's value at `update_index` (a tensor)."""
        return prepared(update_index)

    def first(self, rule: WindowRule) -> int:
        """The rule's length at update 0, as a Python int."""
        return int(rule.length(0))


class WindowRule:
    """When the open window is due: after `steps` micro-batches (an integer, sorted
    `(from_update, k)` pairs, or a callable `update_index -> int`), or once its total
    weight reaches `weight_per_update`.

    Args:
        steps: as given to `accumulate` (checked here), or None.
        weight_per_update: a weight budget > 0, or None. Not with `steps`.
        runner: how the backend's step runs a `steps` callable (`ScheduleRunner`).

    Examples:

        >>> from gradaccum.core.window import WindowRule
        >>> rule = WindowRule([(0, 1), (2, 4)])
        >>> [int(rule.length(update)) for update in range(4)]
        [1, 1, 4, 4]
        >>> rule.constant is None, WindowRule(8).constant
        (True, 8)
    """

    def __init__(self, steps=None, weight_per_update=None,
                 runner: ScheduleRunner | None = None):
        if isinstance(steps, NoiseScaleSchedule):
            # k follows the windows' noise scale (`core.noise_scale`): no budget.
            if weight_per_update is not None:
                check_window_rule(steps, weight_per_update)  # raises: not both
            self.steps, self.weight_per_update = steps, None
        else:
            self.steps, self.weight_per_update = check_window_rule(steps,
                                                                   weight_per_update)
        self.runner = runner or ScheduleRunner()
        if callable(self.steps):
            # Ready to run in the backend's step, then tried on update 0: a wrong
            # type or a first window below 1 is refused before a step runs.
            self._prepared = self.runner.prepare(self.steps)
            first = self.runner.first(self)
            if first < 1:
                raise ValueError(f"{SCHEDULE_RULE} Received: {first} for update_index=0")

    @property
    def constant(self) -> int | None:
        """The window's length when it never changes (an integer `steps`)."""
        return self.steps if isinstance(self.steps, int) else None

    @property
    def scheduled(self) -> bool:
        """Whether the window's length depends on the update index."""
        return self.steps is not None and self.constant is None

    @property
    def follows(self) -> bool:
        """Whether the window's length follows the noise scale
        (`NoiseScaleSchedule`)."""
        return isinstance(self.steps, NoiseScaleSchedule)

    def length(self, update_index):
        """The length (a tensor of the runner's `length_dtype`) of the window that
        makes update `update_index` (counted from 0); 0 with a weight budget (no
        length)."""
        ops = keras.ops
        dtype = self.runner.length_dtype
        if self.steps is None:
            return ops.convert_to_tensor(0, dtype)
        if self.follows:
            # Its first windows' (later ones' are read from the state).
            return ops.convert_to_tensor(self.steps.initial_steps, dtype)
        if callable(self.steps):
            value = self.runner.value(self._prepared, update_index)
            return ops.cast(checked_schedule_value(value), dtype)
        if self.constant is not None:
            return ops.convert_to_tensor(self.constant, dtype)
        starts = ops.convert_to_tensor([start for start, _ in self.steps], "int32")
        lengths = ops.convert_to_tensor([k for _, k in self.steps], dtype)
        index = ops.reshape(ops.cast(update_index, "int32"), (1,))
        # The last pair starting at or before the update (the first starts at 0).
        position = ops.searchsorted(starts, index, side="right")[0] - 1
        return ops.take(lengths, position)


def checked_schedule_value(value):
    """A `steps` callable's value, refused unless it is an integer scalar (each
    backend's runner calls the callable its own way; the rule checks its value here)."""
    return check_callable_result(
        value,
        "steps",
        kind="an integer >= 1",
        scalar="a scalar integer >= 1",
        accepts=is_integer_dtype,
    )
