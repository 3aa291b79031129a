"""What `fit` says once where accumulation cannot be exact, on every backend (this
module runs in the TensorFlow and in the JAX process), as `audit` names it (issue
46, item 3). A model's own step in keras.io's DCGAN order is warned about in each
backend's own-step tests; an optimizer applied twice per batch is a warning on
TensorFlow (tests/test_defects.py) and an error on JAX (test_jax_own_step.py)."""

from __future__ import annotations

import warnings

import keras
import numpy as np

import gradaccum

APPROXIMATE = "weighting='exact' is approximate for this model"
UNCHECKED = "weighting='exact' cannot check"


def _two_outputs_functional():
    inputs = keras.Input((4,))
    return keras.Model(inputs, [keras.layers.Dense(1, name="a")(inputs),
                                keras.layers.Dense(1, name="b")(inputs)])


class TwoOutputs(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(1)
        self.b = keras.layers.Dense(1)

    def call(self, x):
        return [self.a(x), self.b(x)]


def _fit_with_output_weights(model, second_weights):
    """One compiled loss given to both outputs (Keras broadcasts it), its
    normalizer the sum of each output's own sample weights. Returns the messages
    of the warnings fit gave."""
    model(np.zeros((1, 4), "float32"))
    gradaccum.accumulate(model, steps=2)
    model.compile("sgd", loss=keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, [y, y], sample_weight=[np.ones(16, "float32"), second_weights],
                  batch_size=4, epochs=1, shuffle=False, verbose=0)
    return [str(w.message) for w in caught]


def test_a_loss_broadcast_to_several_outputs_is_checked_term_by_term():
    # The second output's weights make its normalizer's ratio to the first's change
    # within each window: one weight per micro-batch cannot be exact. Before, on
    # TensorFlow the state counted one term and said nothing.
    unequal = np.where(np.arange(16) < 6, 3.0, 0.2).astype("float32")
    messages = _fit_with_output_weights(_two_outputs_functional(), unequal)
    assert sum(APPROXIMATE in m for m in messages) == 1, messages


def test_equal_ratios_across_the_outputs_say_nothing():
    messages = _fit_with_output_weights(_two_outputs_functional(),
                                        np.full(16, 2.0, "float32"))
    assert not [m for m in messages if "weighting='exact'" in m], messages


def test_a_subclassed_models_outputs_are_checked_too():
    # A subclassed model has no `outputs` before Keras builds its compiled loss
    # (on TensorFlow after the state is made): the state has room for up to 8
    # terms, so its two outputs are checked as the functional model's are.
    unequal = np.where(np.arange(16) < 6, 3.0, 0.2).astype("float32")
    messages = _fit_with_output_weights(TwoOutputs(), unequal)
    assert sum(APPROXIMATE in m for m in messages) == 1, messages
    assert not [m for m in messages if UNCHECKED in m], messages
    messages = _fit_with_output_weights(TwoOutputs(), np.full(16, 2.0, "float32"))
    assert not [m for m in messages if "weighting='exact'" in m], messages
