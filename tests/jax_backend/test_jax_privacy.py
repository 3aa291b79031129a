"""gradaccum.Privacy on JAX: each example's gradient clipped (jax.vmap of jax.grad),
noise once per window, the same accountant as on TensorFlow."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from largebatch import SCE

from privacy_cases import (  # noqa: F401 (collected here, in this backend's process)
    test_split_mode_equals_steps_and_the_accountant_is_dp_accountings,
    test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b,
    test_what_privacy_refuses_per_example,
    test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients,
)


def clipped_reference(model, optimizer, windows, clip):
    """One step per window on the mean of its per-example-clipped gradients, plus the
    weight regularizers' gradient as it is."""
    model.compile(optimizer=optimizer, loss=SCE)
    optimizer.build(model.trainable_variables)
    for x, y, sample_weight in windows:
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def example_loss(weights, x1, y1, w1, non_trainable=non_trainable):
            y_pred, _ = model.stateless_call(weights, non_trainable, x1, training=True)
            return SCE(y1, y_pred, w1)

        total = [np.zeros(v.shape, "float32") for v in trainable]
        for i in range(len(x)):
            grads = jax.grad(example_loss)(trainable, x[i:i + 1], y[i:i + 1],
                                           sample_weight[i:i + 1])
            norm = float(np.sqrt(sum(float(np.sum(np.square(g))) for g in grads)))
            total = [t + np.asarray(g) * (clip / max(norm, clip)) for t, g in zip(total, grads)]
        mean = [t / len(x) for t in total]

        def penalty(weights):
            mapping = list(zip(model.trainable_variables, weights))
            with keras.StatelessScope(state_mapping=mapping):
                return sum(model.losses)

        if model.losses:
            mean = [m + np.asarray(p) for m, p in zip(mean, jax.grad(penalty)(trainable))]
        optimizer.apply(mean, model.trainable_variables)
    return model


@pytest.fixture(name="clipped_reference")
def clipped_reference_fixture():
    return clipped_reference
