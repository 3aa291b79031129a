"""wrap shares accumulate's mechanism, and says when a model's own training would
not run under it."""

from __future__ import annotations

import warnings

import keras
import pytest
import tensorflow as tf

import gradaccum
from helpers import make_mlp


class OwnLoss(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training) + 1.0


class OwnStep(OwnLoss):
    def train_step(self, data):
        return {}


@pytest.mark.parametrize(
    "model, named",
    [(OwnLoss(), "`compute_loss`"), (OwnStep(), "`train_step`, `compute_loss`")],
    ids=["compute_loss", "train_step"],
)
def test_wrap_warns_that_the_models_own_training_does_not_run(model, named):
    with pytest.warns(UserWarning) as record:
        gradaccum.wrap(model, steps=2)
    assert str(record[0].message) == (
        f"gradaccum.wrap trains {type(model).__name__} with the wrapper's own step and "
        f"compiled loss, so its own {named} will not run. Use "
        "`gradaccum.accumulate(model, steps=...)`, which trains the model through its "
        "own fit, train_step and compute_loss."
    )


def test_wrap_of_a_plain_model_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = gradaccum.wrap(make_mlp(), steps=2)
    assert trainer._accumulation.options.steps == 2
    assert isinstance(trainer._accumulation.normalizers.values, list)
    assert tf.is_tensor(tf.constant(0))
