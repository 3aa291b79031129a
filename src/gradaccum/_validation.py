"""Argument checks shared by the public API.

Every message has the fixed form ``"`name` must be <what>. Received: name=<value>"``,
so users see the argument, the rule and the value they passed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np


def check_steps(steps, *, allow_none: bool = False, name: str = "steps"):
    """Returns `steps` as an int, or raises the fixed-form ValueError."""
    if steps is None and allow_none:
        return None
    if (
        isinstance(steps, bool)
        or not isinstance(steps, (numbers.Integral, np.integer))
        or int(steps) < 1
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={steps!r}"
        )
    return int(steps)


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """Returns `value` if it is one of `choices`, else raises ValueError."""
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(
            f"`{name}` must be one of {allowed}. Received: {name}={value!r}"
        )
    return value


def check_weight_value(weight) -> None:
    """Checks a concrete (eager) micro-batch weight: finite and >= 0."""
    value = np.asarray(weight)
    if value.size != 1:
        raise ValueError(
            "`weight` must be a scalar. "
            f"Received: weight with shape {tuple(value.shape)}"
        )
    value = float(value.reshape(()))
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`weight` must be a finite number >= 0. Received: weight={value!r}"
        )
