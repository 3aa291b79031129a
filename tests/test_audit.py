"""`gradaccum.audit` on TensorFlow: the cases every backend shares (audit_cases.py)
and a step that applies an optimizer twice per batch."""

from __future__ import annotations

import numpy as np

import gradaccum
from audit_cases import *  # noqa: F403 (the shared test cases)
from test_defects import _two_heads


def test_an_optimizer_applied_twice_per_batch_is_named():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 5)).astype("float32"), np.arange(16) % 3
    report = gradaccum.audit(_two_heads("twice"), x, y, steps=2, batch_size=8)
    assert not report.exact
    assert report.causes == [
        "The model's train_step applies `self.optimizer` 2 times per batch: accumulation "
        "makes those updates from gradients taken at the weights the window started "
        "from, where the large batch's step takes each after the previous update."
    ]
