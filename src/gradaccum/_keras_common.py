"""The private Keras pieces gradaccum uses on every backend (no TensorFlow, no JAX).

Exact weighting divides by the same normalizer as Keras's loss reduction, so it reuses
Keras's own masking and rank-matching helpers; the fit integration runs the model's
own loss computation and restores the compile the user made.
`backends/tensorflow/keras_compat` adds the TensorFlow backend's pieces and re-exports
these; `PRIVATE_PIECES` here is checked against the installed Keras by a test on each
backend, so a Keras release that changes one fails loudly in one place.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import keras
from keras.src.backend.common.masking import get_keras_mask  # noqa: F401 (re-exported)
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.losses.loss import (  # noqa: F401 (re-exported)
    apply_mask,
    squeeze_or_expand_to_same_rank,
)
from keras.src.losses.losses import LossFunctionWrapper  # noqa: F401 (re-exported)
from keras.src.trainers.epoch_iterator import EpochIterator
from keras.src.trainers.trainer import Trainer
from keras.src.utils.io_utils import ask_to_proceed_with_overwrite  # noqa: F401 (re-exported)

# (owner, attribute, parameters after `self` that gradaccum passes; None: an
# attribute read, not called). Module-level functions have the module as owner.
PRIVATE_PIECES = (
    (keras.src.losses.loss, "apply_mask", ("sample_weight", "mask", "dtype", "reduction")),
    (keras.src.losses.loss, "squeeze_or_expand_to_same_rank", ("x1", "x2")),
    (keras.src.backend.common.masking, "get_keras_mask", ("x",)),
    (keras.src.losses.losses, "LossFunctionWrapper", ("fn",)),
    (keras.layers.Layer, "_flatten_layers", ("include_self", "recursive")),
    (Trainer, "_compute_loss", ("x", "y", "y_pred", "sample_weight", "training")),
    (Trainer, "_symbolic_build", ("iterator", "data_batch")),
    # gradaccum.exact_epochs: an epoch's last call takes only what is left of it.
    (EpochIterator, "_enumerate_iterator", ()),
    (EpochIterator, "_get_iterator", ()),
    (EpochIterator, "_interrupted_warning", ()),
    (EpochIterator, "catch_stop_iteration", ()),
    (keras.src.backend.common.stateless_scope, "get_stateless_scope", ()),
    (keras.src.backend.common.stateless_scope.StatelessScope, "get_current_value",
     ("variable",)),
    (keras.src.backend.common.stateless_scope.StatelessScope, "add_update", ("update",)),
)

# Instance attributes read (checked on live objects by the tests): an optimizer's
# `_trainable_variables` (the variables it was built with, in order); Model's
# `_call_has_training_arg`, `_loss_tracker`, `_compile_loss` (with `_flat_losses` or
# `_user_loss`), `_compile_config` (a SerializableDict with `.config`) and
# `_metrics` (the list `Model.metrics` extends; a CompileLoss's `_metrics` holds the
# per-output loss metrics its call updates, set aside by privacy's per-example pass).


def missing(pieces) -> list[str]:
    """What of `pieces` (as `PRIVATE_PIECES`) the installed Keras lacks or calls
    otherwise."""
    problems = []
    for owner, name, parameters in pieces:
        where = f"{getattr(owner, '__name__', owner)}.{name}"
        piece = getattr(owner, name, None)
        if piece is None:
            problems.append(f"{where} is missing")
            continue
        if parameters is None:
            continue
        target = piece.__init__ if inspect.isclass(piece) else piece
        names = [p for p in inspect.signature(target).parameters if p != "self"]
        if list(parameters) != names[: len(parameters)]:
            problems.append(f"{where} takes {names}, gradaccum passes {list(parameters)}")
    return problems


def compile_config(model):
    """What the model's last `Trainer.compile` received (Keras keeps it to save the
    model's compile), as a dict; None before `compile`."""
    saved = getattr(model, "_compile_config", None)
    return None if saved is None else dict(saved.config)


def set_compile_config(model, config: dict) -> None:
    """Makes `config` what the model saves as its compile."""
    from keras.src.saving.serialization_lib import SerializableDict

    model._compile_config = SerializableDict(**config)


def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def compute_loss(model, x, y, y_pred, sample_weight):
    """The model's own loss in training (its `compute_loss`, its compiled loss and
    regularization losses), as Keras's train step computes it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model):
    """The metric behind the `loss` entry of the model's logs."""
    return model._loss_tracker


def compiled_loss(model):
    """The model's CompileLoss, or None before `compile` (or without a loss)."""
    return getattr(model, "_compile_loss", None)


def count_compiled_losses(compile_loss, model=None) -> int:
    """How many loss terms a model's compiled loss (Keras's CompileLoss) holds: its
    built terms, or before it is built those it will build, a single loss counted
    once per output of `model` (Keras gives it to each)."""
    if compile_loss is None:
        return 0
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is not None:
        return len(flat)
    user = compile_loss._user_loss
    count = len([loss for loss in keras.tree.flatten(user) if loss is not None])
    if not keras.tree.is_nested(user) and model is not None:
        try:
            outputs = model.outputs
        except (AttributeError, ValueError):
            outputs = None
        if outputs:
            count = max(count, len(keras.tree.flatten(outputs)))
    return count


def flatten_layers(layer) -> list:
    """`layer` and every layer inside it, nested models included."""
    return layer._flatten_layers(include_self=True, recursive=True)


def is_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.Optimizer)


def named_optimizers(model) -> list:
    """The Keras optimizers a model holds, each once, with the name the model reaches
    it by: `optimizer` first, then its other attributes (a GAN's `d_optimizer`), and
    those kept in a list or dict attribute (`opts[1]`, `extra['b']`)."""
    candidates = [("optimizer", getattr(model, "optimizer", None))]
    # TensorFlow's trackable bookkeeping (`_self_unconditional_dependency_names`)
    # holds every attribute again: the model's own names come from its attributes.
    attributes = [(name, value) for name, value in vars(model).items()
                  if not name.startswith("_self_")]
    candidates += [(name, value) for name, value in attributes
                   if not isinstance(value, (dict, list, tuple))]
    for name, value in attributes:
        if isinstance(value, dict):
            candidates += [(f"{name}[{key!r}]", item) for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            candidates += [(f"{name}[{index}]", item) for index, item in enumerate(value)]
    found: list[tuple[str, Any]] = []
    for name, optimizer in candidates:
        if is_optimizer(optimizer) and all(optimizer is not other for _, other in found):
            found.append((name, optimizer))
    return found


def optimizer_name(model, optimizer) -> str:
    """The name `model` reaches `optimizer` by (`named_optimizers`), or "optimizer"."""
    return next((name for name, found in named_optimizers(model) if found is optimizer),
                "optimizer")


class UnroutedUpdates:
    """Watches a model's own step for Keras optimizers it applies that gradaccum did
    not route (held neither as an attribute of the model nor in one: a helper
    object's, a closure's): they update at every micro-batch, which `fit` warns of
    once per optimizer. While `watching`, Keras's optimizer class runs a check before
    its `apply`; the routed optimizers' own `apply` is an instance attribute and
    passes by it."""

    def __init__(self) -> None:
        self.model_name = ""
        self.warned: set[int] = set()
        self._known: set[int] = set()

    @contextlib.contextmanager
    def watching(self, routed, model_name: str):
        # The routed optimizers and what they apply through (a LossScaleOptimizer's
        # inner optimizer) are known.
        known = set()
        for optimizer in routed:
            known.add(id(optimizer))
            inner = getattr(optimizer, "inner_optimizer", None)
            if inner is not None:
                known.add(id(inner))
        self._known, self.model_name = known, model_name
        base = keras.optimizers.Optimizer
        had, original = "apply" in base.__dict__, base.apply
        watcher = self

        def apply(self, *args, **kwargs):
            watcher.noted(self)
            return original(self, *args, **kwargs)

        base.apply = apply
        try:
            yield
        finally:
            if had:
                base.apply = original
            else:
                del base.apply

    def noted(self, optimizer) -> None:
        if id(optimizer) in self._known or id(optimizer) in self.warned:
            return
        self.warned.add(id(optimizer))
        warnings.warn(
            f"The train_step of {self.model_name} applied a "
            f"{type(optimizer).__name__} optimizer ({optimizer.name!r}) that the model "
            "does not hold as an attribute: gradaccum accumulates for the optimizers "
            "it finds on the model (`self.optimizer`, `self.d_optimizer`, one in a "
            "list or dict attribute), so this one updates at every micro-batch, not "
            "once per window. Assign it to an attribute of the model.",
            stacklevel=2,
        )


def is_loss_scale_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def uses_default_train_step(model) -> bool:
    """Whether the model's class trains with Keras's own `train_step` (its backend's)."""
    return type(model).train_step is keras.Model.train_step


def model_metrics(model) -> list:
    """The list of metrics a model tracks itself, which `Model.metrics` (and so the
    state the JAX trainer carries through its step) includes."""
    return model._metrics


@contextlib.contextmanager
def loss_metrics_set_aside(compile_loss):
    """A compiled loss of several outputs that does not update its per-output loss
    metrics (Keras pairs its losses with `_metrics`; None: no metric): per example
    those updates would count each example as a batch."""
    metrics = getattr(compile_loss, "_metrics", None)
    if not metrics:
        yield
        return
    saved = list(metrics)
    metrics[:] = [None] * len(saved)
    try:
        yield
    finally:
        metrics[:] = saved


def built_variables(optimizer) -> list:
    """The variables a built optimizer updates, in the order it was built with."""
    return list(optimizer._trainable_variables)


@contextlib.contextmanager
def stateless_updating_only(optimizer, keep):
    """Within the block (a stateless `optimizer.stateless_apply`), the optimizer's
    per-variable step changes a variable's slots only where `keep` (a dict of
    boolean tensors by `id` of the variables it was built with) holds: what the step
    assigned is kept or reverted with a `where`, decided at run time. (The variable
    itself the caller keeps or reverts.)"""
    update_step = optimizer.update_step

    def masked_step(gradient, variable, learning_rate):
        scope = get_stateless_scope()
        watched = [variable, *optimizer.variables]
        before = [scope.get_current_value(v) for v in watched]
        update_step(gradient, variable, learning_rate)
        kept = keep.get(id(variable))
        if kept is None:
            return
        for watched_variable, old in zip(watched, before):
            new = scope.get_current_value(watched_variable)
            if old is not None and new is not old:
                scope.add_update((watched_variable, keras.ops.where(kept, new, old)))

    optimizer.update_step = masked_step
    try:
        yield
    finally:
        del optimizer.update_step


@contextlib.contextmanager
def overriding(obj, **methods):
    """Sets instance attributes for the block, then puts back what was there."""
    missing = object()
    previous = {name: obj.__dict__.get(name, missing) for name in methods}
    for name, method in methods.items():
        setattr(obj, name, method)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
