"""gradaccum.Privacy on PyTorch: each example's gradient clipped (torch.func's vmap of
grad over the model's stateless call), noise once per window, the same accountant as
on TensorFlow and JAX."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from largebatch import SCE

from privacy_cases import (  # noqa: F401 (collected here, in this backend's process)
    test_split_mode_equals_steps_and_the_accountant_is_dp_accountings,
    test_the_noise_of_an_update_has_standard_deviation_sigma_c_over_b,
    test_what_privacy_refuses_per_example,
    test_without_noise_the_update_is_the_mean_of_per_example_clipped_gradients,
)


def clipped_reference(model, optimizer, windows, clip):
    """One step per window on the mean of its per-example-clipped gradients (each
    example's own backward pass), plus the weight regularizers' gradient as it is."""
    model.compile(optimizer=optimizer, loss=SCE)
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    for x, y, sample_weight in windows:
        total = [np.zeros(v.shape, "float32") for v in variables]
        for i in range(len(x)):
            model.zero_grad()
            loss = SCE(torch.as_tensor(y[i:i + 1]), model(x[i:i + 1], training=True),
                       torch.as_tensor(sample_weight[i:i + 1]))
            loss.backward()
            grads = [v.value.grad.numpy().copy() for v in variables]
            norm = float(np.sqrt(sum(float(np.sum(np.square(g))) for g in grads)))
            total = [t + g * (clip / max(norm, clip)) for t, g in zip(total, grads)]
        mean = [t / len(x) for t in total]
        if model.losses:
            model.zero_grad()
            sum(model.losses).backward()
            mean = [m + (np.zeros(m.shape, "float32") if v.value.grad is None
                         else v.value.grad.numpy()) for m, v in zip(mean, variables)]
        with torch.no_grad():
            optimizer.apply([torch.as_tensor(m) for m in mean], variables)
    return model


@pytest.fixture(name="clipped_reference")
def clipped_reference_fixture():
    return clipped_reference
