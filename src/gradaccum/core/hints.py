"""The type hints of gradaccum's public signatures, named once: what each option
admits, as the checks admit it (`gradaccum.core.options` says what each means).
A NumPy integer or float is as good as Python's; tensors, of every backend, are
`Any`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, SupportsFloat, SupportsIndex, TypeAlias

import numpy as np

from gradaccum.core.noise_scale import NoiseScaleSchedule

Integer: TypeAlias = SupportsIndex
"""An integer: a Python `int`, or anything with `__index__` (NumPy's integers)."""

Real: TypeAlias = SupportsFloat
"""A real number: anything `float()` takes (Python's and NumPy's numbers)."""

Steps: TypeAlias = (SupportsIndex | Sequence[Sequence[SupportsIndex]] | np.ndarray
                    | Callable[[Any], Any] | NoiseScaleSchedule)
"""`steps`, the micro-batches per update: an integer; or a schedule, as
`(from_update, k)` pairs (tuples, lists or an `(n, 2)` array), a callable
`update_index -> k`, or a `NoiseScaleSchedule` (k follows the noise scale)."""

Weighting: TypeAlias = str | Callable[[Any, Any, Any], Any]
"""`weighting`: `"exact"`, `"uniform"`, or a callable `(x, y, sample_weight) -> weight`."""

Nonfinite: TypeAlias = str | Callable[[Any], Any]
"""`nonfinite`: `"skip"`, `"raise"`, `"apply"`, or a callable `gradients -> bool`
(True skips the micro-batch)."""

DType: TypeAlias = Any
"""`accumulator_dtype`: a dtype's name (`"float32"`), or a backend's or NumPy's dtype."""
