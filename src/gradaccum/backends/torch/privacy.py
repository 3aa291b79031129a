"""DP-SGD on PyTorch: each example's gradient, clipped, summed over a micro-batch
(`clipped_micro_batch`), and the window's noise, added once when it is applied
(`Noise`). The options and the accounting are `gradaccum.core.privacy`'s.

Per-example gradients come from `torch.func`: `vmap` of `grad` over the
micro-batch's examples, each through the model's stateless forward pass
(`model.stateless_call`) and compiled loss.
"""

from __future__ import annotations

import hashlib

import keras
import torch

from gradaccum import _keras_common as kc
from gradaccum.backends.torch.record import tensor
from gradaccum.core.privacy import (
    check_example_losses,
    clip_factors,
    per_example_inputs,
    regularized_variables,
)


def clipped_micro_batch(step, x, y, sample_weight):
    """One micro-batch's examples through the model, each example's gradient clipped
    to `privacy.l2_norm_clip` (the `TrainStep.gradients` of a private fit).

    Returns:
        `(loss, y_pred, weight, gradients, normalizers, weighted, unit)`: the micro-batch's
        loss as Keras computes it, its predictions, its number of examples, the sum
        of the clipped per-example gradients plus that number times the weight
        regularizers' gradient, no normalizers, and True (the gradients carry the
        weight).
    """
    model = step.model
    privacy = step.options.privacy
    compile_loss, elements = per_example_inputs(model, kc.compiled_loss(model), x, y,
                                                 sample_weight)
    kwargs = {"training": True} if kc.call_has_training_arg(model) else {}
    regularized = regularized_variables(model)
    trainable = [v.value.detach() for v in model.trainable_variables]
    non_trainable = [v.value.detach() for v in model.non_trainable_variables]
    elements = keras.tree.map_structure(lambda t: tensor(keras.ops.convert_to_tensor(t)),
                                        elements)

    def example_loss(trainable, element):
        single = keras.tree.map_structure(lambda t: t[None], element)
        y_pred, _, losses = model.stateless_call(
            trainable, non_trainable, single["x"], return_losses=True, **kwargs)
        check_example_losses(model, losses, regularized)
        with kc.loss_metrics_set_aside(compile_loss):
            loss = compile_loss(single.get("y"), y_pred, single.get("sample_weight"))
        return loss

    gradients = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0),
                                randomness="different")(trainable, elements)
    examples = int(keras.tree.flatten(x)[0].shape[0])
    squares = sum(g.float().reshape(examples, -1).square().sum(dim=1) for g in gradients)
    factors = clip_factors(squares, privacy.l2_norm_clip)
    clipped = [torch.tensordot(factors.to(g.dtype), g, dims=1) for g in gradients]
    if regularized:
        penalty = _regularization_gradients(model, trainable, non_trainable)
        clipped = [c + (examples * p).to(c.dtype) for c, p in zip(clipped, penalty)]
    # The micro-batch's loss and predictions as Keras computes them (the forward
    # pass moves the non-trainable variables once, as Keras's step does).
    with torch.no_grad():
        y_pred = model(x, **kwargs)
        loss = kc.compute_loss(model, x, y, y_pred, sample_weight)
    return (loss, y_pred, torch.tensor(float(examples)), clipped, None, True, None)


def _regularization_gradients(model, trainable, non_trainable):
    """The gradient of the weight regularizers at `trainable`: they depend on the
    weights only, so they are neither clipped nor noised."""

    def penalty(trainable):
        mapping = list(zip(model.trainable_variables, trainable)) + list(
            zip(model.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=mapping):
            losses = model.losses
        return sum(tensor(loss).float() for loss in losses)

    return torch.func.grad(penalty)(trainable)


class Noise:
    """The window's noise, added once when it is applied: `N(0, (sigma C)^2)` per
    element, drawn from a generator seeded by the privacy's seed, the update's index
    and the variable's place (the same noise on every run with the seed, and on
    every process)."""

    def __init__(self, privacy):
        self.privacy = privacy
        self.seed = privacy.noise_seed()

    def seed_of(self, update: int, index: int) -> int:
        digest = hashlib.sha256(f"{self.seed}/{update}/{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF

    def __call__(self, record, sums) -> list:
        stddev = self.privacy.noise_stddev
        if stddev == 0:
            return sums
        update = int(record.get("updates"))
        noisy = []
        for index, total in zip(record.slots, sums):
            generator = torch.Generator(device=total.device)
            generator.manual_seed(self.seed_of(update, index))
            noise = torch.randn(total.shape, generator=generator, device=total.device,
                                dtype=torch.float32)
            noisy.append(total + (stddev * noise).to(total.dtype))
        return noisy
