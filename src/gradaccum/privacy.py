"""`gradaccum.privacy_spent`: the epsilon a model's private training spent so far.

The options (`gradaccum.Privacy`) and the accounting are `gradaccum.core.privacy`'s;
this reads a model's accumulation (`gradaccum.adapter.accumulation_of`), above both.
"""

from __future__ import annotations

import keras

from gradaccum.adapter import accumulation_of
from gradaccum.core.hints import Integer, Real
from gradaccum.core.privacy import spent


def privacy_spent(model: keras.Model, dataset_size: Integer | None = None,
                  delta: Real | None = None) -> float:
    """The epsilon spent by the updates `model` made so far with `gradaccum.Privacy`.

    Each update is counted as a Poisson sample of the dataset at the rate
    `q = window / dataset_size`, with the largest window seen so far: a window the
    data ended in the middle of (smaller, so less revealing) is counted as a full
    one, which can only overstate epsilon. What the accountant assumes (Poisson
    sampling) is not what `fit` does (shuffled windows of a fixed size): see
    `gradaccum.Privacy`.

    Args:
        model: a model trained with `gradaccum.accumulate(..., privacy=...)` (or an
            `AccumulatingModel` with `privacy`).
        dataset_size: the number of training examples (default: the `Privacy`'s).
        delta: the delta of (epsilon, delta)-DP, in (0, 1) (default: the
            `Privacy`'s).

    Returns:
        epsilon, a float (`inf` with `noise_multiplier=0`, 0 before any update).

    Raises:
        ValueError: a model that does not train with privacy, a missing or invalid
            `dataset_size` or `delta`, a `dataset_size` smaller than a window.

    Example: see `gradaccum.Privacy`.
    """
    accumulation = accumulation_of(model) if isinstance(model, keras.Model) else None
    privacy = None if accumulation is None else accumulation.options.privacy
    if privacy is None:
        raise ValueError(
            "`model` must train with gradaccum.Privacy (`gradaccum.accumulate(model, "
            f"steps, privacy=...)`). Received: model={getattr(model, 'name', model)!r}"
        )
    assert accumulation is not None  # it holds `privacy`
    return spent(accumulation.options.privacy, accumulation.privacy_record(), dataset_size,
                 delta)
