"""The few private Keras pieces gradaccum relies on, in one place.

Exact weighting must divide by the same normalizer as Keras's loss reduction, so it
reuses Keras's own masking and rank-matching helpers rather than re-deriving them.
Under tf.distribute, gradaccum reduces gradients itself, once per update, and has
Keras's optimizer apply them from the cross-replica context.
"""

import contextlib

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses.loss import (
    apply_mask,
    squeeze_or_expand_to_same_rank,
    unscale_loss_for_distribution,
)
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models.functional import Functional


def count_compiled_losses(compile_loss) -> int:
    """How many loss terms a model's compiled loss (Keras's CompileLoss) holds."""
    if compile_loss is None:
        return 0
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is None:
        flat = [loss for loss in tf.nest.flatten(compile_loss._user_loss) if loss is not None]
    return len(flat)


def flatten_layers(layer) -> list:
    """`layer` and every layer inside it, nested models included."""
    return layer._flatten_layers(include_self=True, recursive=True)


def is_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.Optimizer)


def is_loss_scale_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def back_off_loss_scale(optimizer) -> None:
    """Keras's own reaction of a LossScaleOptimizer to non-finite gradients:
    the scale halves and the count of finite steps restarts."""
    optimizer._stateful_handle_non_finite_grads()


def grow_loss_scale(optimizer) -> None:
    """A LossScaleOptimizer's count of finite steps, as Keras keeps it: after
    `dynamic_growth_steps` finite steps in a row the scale doubles."""

    def upscale():
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)

    def increment():
        optimizer.step_counter.assign_add(1)

    keras.ops.cond(
        keras.ops.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1),
        upscale,
        increment,
    )


def tf_variable(variable):
    """The tf.Variable behind a Keras variable (or the variable itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


@contextlib.contextmanager
def applying_across_replicas(optimizer, strategy):
    """Within the block, `optimizer.apply` runs in cross-replica context.

    Keras's TensorFlow optimizer expects a replica context: it all-reduces the
    gradients (after clipping them per replica) and reaches the variables through
    `merge_call`. gradaccum applies the already-reduced global gradient from the
    cross-replica context instead (a replica cannot synchronize inside a `tf.cond`:
    keras issue 20582), so clipping acts on the global gradient and each replica's
    copy of the variables and slots is updated with `strategy.extended.update`. Only
    the two steps that would call `merge_call` are redirected; learning-rate
    schedules, clipping, EMA, constraints and `iterations` stay Keras's own.
    """

    def update_step(grads, trainable_variables, learning_rate):
        pairs = list(zip(grads, [tf_variable(v) for v in trainable_variables]))
        optimizer._distributed_tf_update_step(strategy, pairs, learning_rate)

    def apply_weight_decay(variables):
        if optimizer.weight_decay is None:
            return

        def decay(variable):
            lr = tf.cast(optimizer.learning_rate, variable.dtype)
            wd = tf.cast(optimizer.weight_decay, variable.dtype)
            variable.assign_sub(variable * wd * lr)

        for variable in variables:
            if optimizer._use_weight_decay(variable):
                strategy.extended.update(tf_variable(variable), decay, group=False)

    optimizer._backend_update_step = update_step
    optimizer._apply_weight_decay = apply_weight_decay
    try:
        yield
    finally:
        del optimizer._backend_update_step
        del optimizer._apply_weight_decay


__all__ = [
    "back_off_loss_scale",
    "flatten_layers",
    "grow_loss_scale",
    "is_loss_scale_optimizer",
    "is_optimizer",
    "Functional",
    "LossFunctionWrapper",
    "count_compiled_losses",
    "apply_mask",
    "get_keras_mask",
    "applying_across_replicas",
    "tf_variable",
    "squeeze_or_expand_to_same_rank",
    "unscale_loss_for_distribution",
]
