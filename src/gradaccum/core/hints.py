"""The type hints of gradaccum's public signatures, named once: what each option
admits, as the checks admit it (`gradaccum.core.options` says what each means).
A NumPy integer or float is as good as Python's; tensors, of every backend, are
`Any`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, SupportsFloat, SupportsIndex, TypeAlias

import numpy as np

#: An integer: a Python int or anything with `__index__` (NumPy's integers).
Integer: TypeAlias = SupportsIndex
#: A real number: anything `float()` takes (a Python or NumPy number).
Real: TypeAlias = SupportsFloat
#: `steps`: an integer, `(from_update, k)` pairs (tuples, lists or an `(n, 2)` array),
#: or a callable `update_index -> k`.
Steps: TypeAlias = (SupportsIndex | Sequence[Sequence[SupportsIndex]] | np.ndarray
                    | Callable[[Any], Any])
#: `weighting`: "exact", "uniform", or a callable `(x, y, sample_weight) -> weight`.
Weighting: TypeAlias = str | Callable[[Any, Any, Any], Any]
#: `nonfinite`: "skip", "raise", "apply", or a callable `gradients -> bool` (True skips).
Nonfinite: TypeAlias = str | Callable[[Any], Any]
#: `accumulator_dtype`: a dtype's name ("float32") or a backend's or NumPy's dtype.
DType: TypeAlias = Any
