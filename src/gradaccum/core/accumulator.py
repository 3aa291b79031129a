"""The public API of `gradaccum.GradientAccumulator`, declared once for every backend.

`gradaccum.GradientAccumulator` is the class of Keras's backend
(`backends/<name>/accumulator.py`), for a custom training loop. Each one subclasses
`Accumulator`: its options and the window's counters read alike everywhere.
TensorFlow's and PyTorch's, whose state is variables changed in place, are
`StatefulAccumulator`s (`accumulate`, `step`, `apply`, ...). JAX's is stateless, as
Keras's optimizer is on JAX: it adds `stateless_step`, `stateless_accumulate` and
`stateless_apply`, which take and return the state's values.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

from gradaccum.core import noise_scale
from gradaccum.core.state import WINDOW_NAMES
from gradaccum.core.window import WindowRule


class Accumulator(abc.ABC):
    """What every backend's `GradientAccumulator` holds and shows.

    The options, as checked (each backend sets them): `reduction` (`"mean"` or
    `"sum"`), `accumulator_dtype` (the sums' dtype), `nonfinite` (what happens to a
    micro-batch with a non-finite gradient: a name or the user's callable),
    `target_variables` (the variables whose gradients are accumulated) and
    `accumulators` (one sum per target variable). The counters below are the
    state's variables (`numpy()`, `assign`), the names a checkpoint keeps.
    """

    # When a window is due (`core.window.WindowRule`), set by each backend.
    _rule: WindowRule

    def field(self, name: str) -> Any:
        """The window record's field `name` (`core.state.WINDOW`: `updates`,
        `micro_step`, `total_weight`, `received`, ...) as the backend's variable
        (`numpy()`, `assign`)."""
        if name not in WINDOW_NAMES:
            raise ValueError(
                f"`name` must be a field of the window record ({', '.join(WINDOW_NAMES)}). "
                f"Received: name={name!r}"
            )
        return self._field(name)

    @abc.abstractmethod
    def _field(self, name: str) -> Any:
        """The field `name` as the backend holds it."""

    @abc.abstractmethod
    def state_variables(self) -> dict:
        """Every variable of the state under its stable name."""

    @property
    def steps(self) -> Any:
        """Micro-batches per window: an int, the schedule as given (a callable, or
        the pairs as a tuple), or None."""
        return self._rule.steps

    @property
    def weight_per_update(self) -> float | None:
        """The weight budget of a window (None: not a budget)."""
        return self._rule.weight_per_update

    @property
    def updates(self) -> Any:
        """Updates this accumulator made: the position of a `steps` schedule."""
        return self.field("updates")

    @property
    def micro_step(self) -> Any:
        """Micro-batches accumulated in the open window."""
        return self.field("micro_step")

    @property
    def total_weight(self) -> Any:
        """The total weight of the micro-batches in the open window."""
        return self.field("total_weight")

    @property
    def skipped(self) -> Any:
        """Micro-batches skipped for a non-finite gradient, in all. Under a
        tf.distribute strategy: replicas' shares skipped, summed across replicas,
        counted when their window closes."""
        return self.field("skipped")

    @property
    def micro_batches(self) -> Any:
        """Micro-batches presented since creation, skipped ones included."""
        return self.field("micro_batches")

    @property
    def last_window_micro_batches(self) -> Any:
        """Micro-batches the last update's window held, skipped ones included."""
        return self.field("last_window_micro_batches")

    @property
    def last_window_weight(self) -> Any:
        """The total weight of the last update's window (across replicas or
        processes)."""
        return self.field("last_window_weight")


    @property
    def noise_scale(self) -> float:
        """The gradient noise scale B_simple (`gradaccum.core.noise_scale`): the
        critical batch size's estimate from the windows applied since the
        accumulator was made or `reset_noise_scale` was called, in the unit of the
        weights given (samples where `weight` is the micro-batch's size). NaN
        where no window of two micro-batches or more was applied (or the estimate
        of |G|^2 is not above 0). A read of the state (a host value: not inside a
        compiled function). Needs `noise_scale=True`."""
        return noise_scale.estimate(*(self._noise_field(name).numpy()
                                      for name in noise_scale.TOTALS))

    def reset_noise_scale(self) -> None:
        """Starts a new reading of `noise_scale` (at an epoch's start, say)."""
        for name in noise_scale.TOTALS:
            variable = self._noise_field(name)
            variable.assign(np.zeros_like(variable.numpy()))

    def _noise_field(self, name: str) -> Any:
        named = self.state_variables()
        if name not in named:
            raise ValueError(
                "This accumulator keeps no noise scale: make it with "
                "`noise_scale=True`. Received: noise_scale=False")
        return named[name]


class StatefulAccumulator(Accumulator):
    """The verbs of an accumulator whose state is variables changed in place
    (TensorFlow's and PyTorch's `GradientAccumulator`). Each backend's class
    documents what its arguments admit there."""

    @abc.abstractmethod
    def accumulate(self, gradients: Sequence[Any], weight: Any = 1.0, *,
                   loss_scale_optimizer: Any = None) -> Any:
        """Adds one micro-batch's gradients with its weight `w_i`; returns whether it
        was accumulated (False: skipped for a non-finite gradient)."""

    @abc.abstractmethod
    def accumulate_weighted(self, weighted_gradients: Sequence[Any], weight: Any, *,
                            loss_scale_optimizer: Any = None) -> Any:
        """Adds one micro-batch's gradients that carry its weight already (of
        `weight * loss`), with `weight` to the total."""

    @abc.abstractmethod
    def step(self, optimizer: Any, gradients: Sequence[Any], weight: Any = 1.0) -> Any:
        """Accumulates a micro-batch and applies the window when it is due; returns
        whether this call made an update."""

    @abc.abstractmethod
    def gradients(self) -> list:
        """The open window's combined gradient, without emptying it."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Empties the open window."""

    @abc.abstractmethod
    def apply(self, optimizer: Any) -> Any:
        """Applies the open window (full or partial, normalized by its own weights)
        and empties it; returns whether an update happened."""

    @abc.abstractmethod
    def apply_if(self, optimizer: Any, condition: Any) -> Any:
        """`apply` when `condition` holds and the window holds a micro-batch."""

    @abc.abstractmethod
    def drop(self) -> Any:
        """Discards the open window; returns whether it held a micro-batch."""

    @abc.abstractmethod
    def window_length(self) -> Any:
        """Micro-batches in the open window, skipped ones included."""

    @abc.abstractmethod
    def window_due(self) -> Any:
        """Whether the open window is due: it holds `steps` micro-batches (the
        schedule's length for this window), or its total weight reached
        `weight_per_update`."""
