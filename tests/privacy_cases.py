"""gradaccum.Privacy on JAX and PyTorch alike: imported by
tests/jax_backend/test_jax_privacy.py and tests/torch_backend/test_torch_privacy.py,
each of which provides the `clipped_reference` fixture (the update one step per window
on per-example-clipped gradients, computed with the backend's own differentiation)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from largebatch import SCE, assert_weights_close

import gradaccum
from gradaccum.core import privacy as core_privacy


def tagger(seed=1, regularizer=None):
    """An embedding over 20 ids (repeated inside an example), a regularized dense
    layer, 3 classes."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((6,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(ids))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)(hidden)
    return keras.Model(ids, keras.layers.Dense(3)(hidden), name="tagger")


def tagger_data(n=30, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 5, (n, 6)).astype("int32"), rng.integers(0, 3, n),
            rng.uniform(0.2, 2.0, n).astype("float32"))


def mlp(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(200, activation="tanh"),
                             keras.layers.Dense(3)], name="mlp")


def mlp_data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n)


def test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients(
        clipped_reference):
    """Windows of 3 micro-batches of 4, the last one partial (6 examples), repeated
    embedding rows, sample weights, a weight regularizer, Adam."""
    x, y, sample_weight = tagger_data(30)
    clip = 0.3
    model = gradaccum.accumulate(
        tagger(regularizer=keras.regularizers.L2(0.01)), steps=3,
        privacy=gradaccum.Privacy(l2_norm_clip=clip, noise_multiplier=0.0),
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=SCE)
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=4, shuffle=False,
                        verbose=0)
    assert history.history["updates"] == [3.0]
    assert history.history["window_weight"] == [6.0]
    windows = [(x[s], y[s], sample_weight[s])
               for s in (slice(0, 12), slice(12, 24), slice(24, 30))]
    reference = clipped_reference(tagger(regularizer=keras.regularizers.L2(0.01)),
                                  keras.optimizers.Adam(0.01), windows, clip)
    # (Adam divides by the root of tiny second moments: float32 rounding shows.)
    assert_weights_close(model, reference, atol=1e-5)


@pytest.mark.parametrize("steps", [1, 4])
def test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b(steps):
    """One window of 32 examples as k micro-batches, SGD at rate 1: the noise in the
    update has deviation sigma C / B for k = 1 and 4 alike."""
    x, y = mlp_data(32)
    sigma, clip, examples = 2.0, 0.5, 32

    def one_update(noise_multiplier):
        model = gradaccum.accumulate(mlp(), steps=steps, privacy=gradaccum.Privacy(
            l2_norm_clip=clip, noise_multiplier=noise_multiplier, seed=5))
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=SCE)
        model.fit(x, y, batch_size=examples // steps, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations) == 1
        return np.concatenate([w.ravel() for w in model.get_weights()])

    noise = one_update(sigma) - one_update(0.0)
    assert abs(noise.std() / (sigma * clip / examples) - 1) < 0.06


def test_split_mode_equals_steps_and_the_accountant_is_dp_accountings():
    """micro_batch_size=4 on batches of 12 makes the windows of steps=3 on batches of
    4 (the same seed, the same noise); fit's epsilon is dp-accounting's."""
    x, y = mlp_data(36)

    def trained(batch_size, **window):
        model = gradaccum.accumulate(mlp(), privacy=gradaccum.Privacy(
            0.5, 0.7, seed=11, dataset_size=36, delta=1e-5), **window)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        return model, history

    steps, history = trained(4, steps=3)
    split, _ = trained(12, micro_batch_size=4)
    assert_weights_close(split, steps)
    assert history.history["updates"] == [3.0, 6.0]
    np.testing.assert_allclose(history.history["epsilon"], [
        core_privacy.epsilon(0.7, 12 / 36, 3, 1e-5),
        core_privacy.epsilon(0.7, 12 / 36, 6, 1e-5),
    ])
    assert gradaccum.privacy_spent(steps) == pytest.approx(history.history["epsilon"][-1])


def test_what_privacy_refuses_per_example():
    class AddsLoss(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.mean(x))
            return x

    model = keras.Sequential([keras.Input((5,)), AddsLoss(), keras.layers.Dense(3)],
                             name="adder")
    gradaccum.accumulate(model, steps=2, privacy=gradaccum.Privacy(1.0, 1.0))
    model.compile(optimizer="sgd", loss=SCE)
    x, y = mlp_data(8)
    with pytest.raises(ValueError, match="adds a loss in its call"):
        model.fit(x, y, batch_size=4, verbose=0)
    bn = keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(name="bn"),
                           keras.layers.Dense(3)], name="net")
    with pytest.raises(ValueError, match="BatchNormalization layer 'bn'"):
        gradaccum.accumulate(bn, steps=2, privacy=gradaccum.Privacy(1.0, 1.0))
