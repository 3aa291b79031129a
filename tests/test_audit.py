"""`gradaccum.audit` on TensorFlow: the cases every backend shares (audit_cases.py)
and a step that applies an optimizer twice per batch."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import gradaccum
from audit_cases import *  # noqa: F403 (the shared test cases)
from audit_cases import data, mlp
from test_defects import _two_heads


def _heads_data():
    """16 samples of 5 features and 3 classes for `_two_heads`' models."""
    rng = np.random.default_rng(1)
    return rng.normal(size=(16, 5)).astype("float32"), np.arange(16) % 3


def test_an_optimizer_applied_twice_per_batch_is_named():
    x, y = _heads_data()
    report = gradaccum.audit(_two_heads("twice"), x, y, steps=2, batch_size=8)
    assert not report.exact
    assert report.causes == [
        "The model's train_step applies `self.optimizer` 2 times per batch: accumulation "
        "makes those updates from gradients taken at the weights the window started "
        "from, where the large batch's step takes each after the previous update."
    ]


def test_an_optimizer_applied_to_overlapping_variables_is_named():
    x, y = _heads_data()
    report = gradaccum.audit(_two_heads("overlap"), x, y, steps=2, batch_size=8)
    assert not report.exact
    assert report.causes == [
        "The model's train_step applies `self.optimizer` 2 times per batch: accumulation "
        "makes those updates from gradients taken at the weights the window started "
        "from, where the large batch's step takes each after the previous update."
    ]


def test_two_optimizers_are_exact_unless_a_gradient_follows_an_update():
    x, y = _heads_data()
    # Both gradients from one tape, before either update: exact.
    heads = gradaccum.audit(_two_heads("list"), x, y, steps=2, batch_size=8)
    assert heads.exact and heads.causes == [], str(heads)
    # The second head's gradient taken after the first head's update.
    chained = gradaccum.audit(_two_heads("chained"), x, y, steps=2, batch_size=8)
    assert not chained.exact
    assert chained.causes == [
        "The model's train_step computes the gradients it hands to `self.extra[0]` after "
        "applying `self.optimizer`, from variables `self.optimizer` updates (a GAN in "
        "keras.io's DCGAN order): on the large batch they see that update; accumulated, "
        "they are taken at the weights the window started from."
    ]


def test_audit_builds_the_optimizer_in_the_models_distribution_scope():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = mlp()
    x, y = data()
    report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
    assert report.exact, str(report)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4


class GlobalDropout(keras.layers.Layer):
    """Dropout drawn from Keras's global seed generator (no seed of its own; JAX
    refuses such draws in a traced step)."""

    def call(self, h, training=False):
        return keras.random.dropout(h, 0.5) if training else h


def test_the_global_seed_generator_is_put_back():
    x, y = data()
    trained = []
    for audited in (False, True):
        keras.utils.set_random_seed(7)
        model = mlp(GlobalDropout())
        if audited:
            gradaccum.audit(model, x, y, steps=4, batch_size=8)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        trained.append(model.get_weights())
    for a, b in zip(*trained):
        np.testing.assert_array_equal(a, b)
