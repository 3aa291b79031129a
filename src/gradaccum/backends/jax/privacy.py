"""DP-SGD on JAX: each example's gradient, clipped, summed over a micro-batch
(`clipped_micro_batch`), and the window's noise, added once when it is applied
(`noised`). The options and the accounting are `gradaccum.core.privacy`'s.

Per-example gradients come from `jax.vmap` of `jax.grad` over the micro-batch's
examples: the model's stateless forward pass and compiled loss of one example each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from gradaccum import _keras_common as kc
from gradaccum.core.privacy import (
    check_example_losses,
    clip_factors,
    per_example_inputs,
    regularized_variables,
)


def clipped_micro_batch(model, privacy, trainable, non_trainable, x, y, sample_weight):
    """One micro-batch's examples through `model`, each example's gradient clipped to
    `privacy.l2_norm_clip`.

    Returns:
        `(gradients, examples, y_pred, non_trainable)`: the sum of the clipped
        per-example gradients plus `examples` times the weight regularizers'
        gradient (one array per trainable variable), the number of examples (float32),
        the micro-batch's predictions and the non-trainable variables after its
        forward pass.
    """
    compile_loss, elements = per_example_inputs(model, kc.compiled_loss(model), x, y,
                                                 sample_weight)
    kwargs = {"training": True} if kc.call_has_training_arg(model) else {}
    regularized = regularized_variables(model)

    def example_loss(trainable, element):
        single = jax.tree_util.tree_map(lambda t: t[None], element)
        y_pred, new_non_trainable, losses = model.stateless_call(
            trainable, non_trainable, single["x"], return_losses=True, **kwargs
        )
        # The weight regularizers' terms come first among them (one per regularized
        # variable); any other is an `add_loss` of a layer's call.
        check_example_losses(model, losses, regularized)
        with kc.loss_metrics_set_aside(compile_loss):
            loss = compile_loss(single.get("y"), y_pred, single.get("sample_weight"))
        return loss, (jax.tree_util.tree_map(lambda t: t[0], y_pred), new_non_trainable)

    gradients, (y_pred, new_non_trainable) = jax.vmap(
        jax.grad(example_loss, has_aux=True), in_axes=(None, 0)
    )(trainable, elements)
    examples = keras.tree.flatten(x)[0].shape[0]
    squares = sum(
        jnp.sum(jnp.square(g.astype("float32")).reshape(examples, -1), axis=1)
        for g in gradients
    )
    factors = clip_factors(squares, privacy.l2_norm_clip)
    clipped = [jnp.tensordot(factors.astype(g.dtype), g, axes=1) for g in gradients]
    penalty = _regularization_gradients(model, trainable, non_trainable)
    if penalty is not None:
        clipped = [c + (examples * p).astype(c.dtype) for c, p in zip(clipped, penalty)]
    # The forward pass's variable updates (a seed generator's) are the same for
    # every example: the first one's.
    new_non_trainable = [v[0] for v in new_non_trainable]
    return clipped, jnp.asarray(examples, "float32"), y_pred, new_non_trainable


def _regularization_gradients(model, trainable, non_trainable):
    """The gradient of the weight regularizers at `trainable` (None without any):
    they depend on the weights only, so they are neither clipped nor noised."""
    if not regularized_variables(model):
        return None

    def penalty(trainable):
        mapping = list(zip(model.trainable_variables, trainable)) + list(
            zip(model.non_trainable_variables, non_trainable)
        )
        with keras.StatelessScope(state_mapping=mapping):
            losses = model.losses
        return sum(jnp.asarray(loss, "float32") for loss in losses)

    return jax.grad(penalty)(trainable)


def noise_key(seed: int):
    """The root key of a model's noise, from a seed in [0, 2**63): its 31-bit parts
    (JAX's default integers are 32-bit). Under several processes (multi-host) the
    first process's seed, so that every host draws the same noise."""
    parts = np.asarray([seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF, seed >> 62], "int32")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        parts = np.asarray(multihost_utils.broadcast_one_to_all(parts))
    key = jax.random.key(int(parts[0]))
    key = jax.random.fold_in(key, int(parts[1]))
    return jax.random.fold_in(key, int(parts[2]))


def noised(sums, privacy, key, update_index):
    """The window's sums with the privacy noise added once: `N(0, (sigma C)^2)` per
    element, from the model's key and the update's index."""
    if privacy.noise_stddev == 0:
        return sums
    key = jax.random.fold_in(key, update_index)
    noisy = []
    for index, total in enumerate(sums):
        noise = jax.random.normal(jax.random.fold_in(key, index), total.shape, "float32")
        noisy.append(total + (privacy.noise_stddev * noise).astype(total.dtype))
    return noisy
