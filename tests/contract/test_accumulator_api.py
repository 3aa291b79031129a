"""Every backend's `gradaccum.GradientAccumulator` is the API declared once in
`gradaccum.core.accumulator`: the same options and counters under the same names, and
TensorFlow's and PyTorch's the same verbs (JAX's, stateless, its `stateless_*` ones)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import gradaccum
from gradaccum.core.accumulator import Accumulator, StatefulAccumulator

COUNTERS = ("updates", "micro_step", "total_weight", "skipped", "micro_batches",
            "last_window_micro_batches", "last_window_weight")


def test_the_backends_accumulator_is_the_declared_one():
    cls = gradaccum.GradientAccumulator
    assert issubclass(cls, Accumulator) and not cls.__abstractmethods__
    stateless = keras.backend.backend() == "jax"
    assert issubclass(cls, StatefulAccumulator) is not stateless
    if stateless:
        for name in ("stateless_step", "stateless_accumulate", "stateless_apply"):
            assert callable(getattr(cls, name))


def test_its_options_and_counters_read_alike_before_and_after_a_window():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=[(0, 2), (1, 3)],
                                        reduction="sum", nonfinite="raise")
    assert acc.steps == ((0, 2), (1, 3)) and acc.weight_per_update is None
    assert acc.reduction == "sum" and acc.nonfinite == "raise"
    assert len(acc.accumulators) == len(acc.target_variables) == 2
    assert {name: float(acc.field(name).numpy()) for name in COUNTERS} == dict.fromkeys(
        COUNTERS, 0.0)
    assert set(acc.state_variables()) >= {"updates", "micro_step", "accumulator_0"}
    assert np.asarray(acc.field("received").numpy()).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"`name` must be a field of the window record "
                                         r"\(total_weight, .*Received: name='accumulators'"):
        acc.field("accumulators")
    if keras.backend.backend() == "jax":
        return  # the stateless verbs: tests/jax_backend/test_jax_accumulator.py
    optimizer = keras.optimizers.SGD(0.1)
    ones = [np.ones(v.shape, "float32") for v in model.trainable_variables]
    acc.step(optimizer, ones, weight=3.0)
    acc.step(optimizer, ones, weight=1.0)
    assert int(acc.updates.numpy()) == 1 and int(acc.micro_step.numpy()) == 0
    assert int(acc.last_window_micro_batches.numpy()) == 2
    assert float(acc.last_window_weight.numpy()) == 4.0
    assert int(acc.micro_batches.numpy()) == 2
    acc.accumulate(ones, 5.0)
    assert int(acc.window_length()) == 1 and not bool(acc.window_due())
    assert float(acc.total_weight.numpy()) == 5.0
