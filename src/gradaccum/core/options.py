"""The accumulation options, declared and checked once for every door and backend."""

from __future__ import annotations

from gradaccum._validation import (
    accumulator_dtype_name,
    check_choice,
    check_nonfinite,
    check_weighting,
    check_window_options,
)
from gradaccum.core.combine import REDUCTIONS
from gradaccum.core.privacy import check_options as check_private_options
from gradaccum.core.privacy import check_privacy
from gradaccum.core.window import PARTIALS, WindowSpec


class Options:
    """The accumulation options, checked once (fixed-form errors).

    One of `steps` (each batch is a micro-batch; `steps` of them make an update,
    `steps` an integer or a schedule by update index), `weight_per_update` (each
    batch is a micro-batch; a window closes once its total weight reaches the
    budget) or `micro_batch_size` (split mode: each batch is split into
    micro-batches of at most that many samples, or `"auto"`, and makes one update).
    """

    # The backend's `WindowSpec` (how a schedule's callable runs).
    window_rule = WindowSpec

    def __init__(self, steps=None, weighting="exact", partial="flush", reduction="mean",
                 accumulator_dtype="float32", nonfinite="skip", *,
                 micro_batch_size=None, max_micro_batch_size=None,
                 weight_per_update=None, privacy=None):
        self.partial = check_choice("partial", partial, PARTIALS)
        self.micro_batch_size, self.max_micro_batch_size = check_window_options(
            steps, micro_batch_size, max_micro_batch_size, partial, weight_per_update
        )
        # When a window closes, checked now (a schedule's callable is tried on
        # update 0) and shared by every accumulator of the fit.
        self.window = self.window_rule(steps, weight_per_update)
        self.weighting = check_weighting(weighting)
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)
        self.accumulator_dtype = accumulator_dtype_name(accumulator_dtype)
        self.nonfinite = check_nonfinite(nonfinite)
        if self.auto and (self.weighting == "uniform" or self.reduction == "sum"):
            raise ValueError(
                '`weighting` must be "exact" or a callable, and `reduction` "mean", '
                'with micro_batch_size="auto": "auto" changes the split, which must not '
                f"change the update. Received: weighting={weighting!r}, "
                f"reduction={reduction!r}"
            )
        # Differentially private training (`gradaccum.Privacy`), or None.
        self.privacy = check_privacy(privacy)
        if self.privacy is not None:
            check_private_options(self)

    @property
    def split(self) -> bool:
        """Whether each batch is split into micro-batches (one update per batch)."""
        return self.micro_batch_size is not None

    @property
    def auto(self) -> bool:
        return self.micro_batch_size == "auto"

    @property
    def steps(self):
        """`steps` as checked: an int, the schedule (pairs as a tuple, or the
        callable), or None."""
        return self.window.steps

    @property
    def weight_per_update(self) -> float | None:
        return self.window.weight_per_update

    def steps_per_execution(self, replicas: int) -> int:
        """Micro-batches a compiled call runs by default (`steps_per_execution`
        "window"): the window's length when it is constant, else 1 (schedules,
        budgets, split mode); 1 under several replicas, where Keras's multi-step
        train function fails (keras issue 19246)."""
        return (self.window.constant or 1) if replicas == 1 else 1
