"""Every private Keras piece gradaccum relies on, and nothing else.

Exact weighting must divide by the same normalizer as Keras's loss reduction, so it
reuses Keras's own masking and rank-matching helpers rather than re-deriving them.
Under tf.distribute, gradaccum reduces gradients itself, once per update, and has
Keras's optimizer apply them from the cross-replica context. The fit integration
runs the model's own loss computation and reads Keras's epoch iterator.

`PRIVATE_PIECES` lists each piece with the parameters gradaccum calls it with;
`missing_pieces()` checks them against the installed Keras (a test does), so a Keras
release that changes one fails loudly in one place.
"""

import contextlib

import keras
import tensorflow as tf
from keras.src.backend import compute_output_spec
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.layers.normalization.batch_normalization import (
    BatchNormalization as _KerasBatchNormalization,
)
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.models.functional import Functional

from gradaccum import _keras_common
from gradaccum._keras_common import (  # noqa: F401 (re-exported)
    LossFunctionWrapper,
    apply_mask,
    call_has_training_arg,
    compile_config,
    compiled_loss,
    compute_loss,
    count_compiled_losses,
    flatten_layers,
    get_keras_mask,
    is_loss_scale_optimizer,
    is_optimizer,
    loss_metrics_set_aside,
    loss_tracker,
    named_optimizers,
    optimizer_name,
    overriding,
    set_compile_config,
    squeeze_or_expand_to_same_rank,
)
from gradaccum.backends.tensorflow.sums import deduplicated

# (owner, attribute, parameters after `self` that gradaccum passes; None: an
# attribute read, not called). Module-level functions have the module as owner.
# The TensorFlow backend's pieces, after the common ones (`_keras_common`).
PRIVATE_PIECES = _keras_common.PRIVATE_PIECES + (
    (keras.src.losses.loss, "unscale_loss_for_distribution", ("value",)),
    (keras.src.models.functional, "Functional", ("inputs", "outputs")),
    (TensorFlowTrainer, "_maybe_symbolic_build", ("iterator", "data_batch")),
    (keras.src.backend, "compute_output_spec", ("fn",)),
    (TFOptimizer, "_var_key", ("variable",)),
    (TFOptimizer, "_apply_weight_decay", ("variables",)),
    (TFOptimizer, "_backend_update_step", ("grads", "trainable_variables", "learning_rate")),
    (TFOptimizer, "_distributed_tf_update_step",
     ("distribution", "grads_and_vars", "learning_rate")),
    (keras.optimizers.Optimizer, "_use_weight_decay", ("variable",)),
    (keras.optimizers.Optimizer, "update_step", ("gradient", "variable", "learning_rate")),
    (_KerasBatchNormalization, "_moments", ("inputs", "mask")),
    (keras.layers.Layer, "_track_variable", ("variable",)),
    (keras.Variable, "__init__",
     ("initializer", "shape", "dtype", "trainable", "autocast", "aggregation",
      "synchronization", "name")),
)

# Instance attributes read (checked on live objects by the tests): Model's
# `_distribute_strategy` (None without a strategy), Keras's TensorFlow epoch
# iterator's `_distributed_dataset` (the data as a tf.data dataset),
# Model's `_call_has_training_arg`, `_loss_tracker`, `_compile_loss` (with `_flat_losses` or
# `_user_loss`), BatchNormalization's `_reduction_axes`, Layer's
# `_trainable_variables` and `_non_trainable_variables`, Model's `_compile_config`
# (a SerializableDict with `.config`), Optimizer's `_trainable_variables`.


def missing_pieces() -> list[str]:
    """What of `PRIVATE_PIECES` the installed Keras lacks or calls otherwise."""
    return _keras_common.missing(PRIVATE_PIECES)


def batch_norm_moments(layer, inputs, mask):
    """Keras's BatchNormalization moments of this replica's micro-batch (mask-aware),
    never synchronized: gradaccum pools the replicas' statistics itself."""
    with overriding(layer, synchronized=False):
        return layer._moments(inputs, mask)


def add_replica_local_weight(layer, name, shape, dtype="float32"):
    """A zeros state variable of `layer`, made as `add_weight` makes one,
    but replica-local under a strategy (synchronized on read, summed when read
    across replicas): each replica updates its own copy without communicating.
    `Layer.add_weight` takes no `synchronization`; `keras.Variable` does."""
    with keras.name_scope(layer.name, caller=layer):
        variable = keras.Variable(
            initializer="zeros", shape=shape, dtype=dtype, trainable=False,
            autocast=False, aggregation="sum", synchronization="on_read", name=name,
        )
    layer._track_variable(variable)
    return variable


def batch_norm_reduction_axes(layer) -> list:
    """The axes a built BatchNormalization layer reduces over."""
    return layer._reduction_axes


def optimizer_variables_of(optimizer) -> list:
    """The variables a built optimizer updates when `apply` gets no variable list."""
    return list(optimizer._trainable_variables)


def own_variables(layer) -> list:
    """A layer's own variables (not those of its sublayers), in Keras's order."""
    return layer._trainable_variables + layer._non_trainable_variables


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

    with overriding(optimizer, _backend_update_step=update_step,
                     _apply_weight_decay=apply_weight_decay):
        yield


@contextlib.contextmanager
def updating_only(optimizer, keep):
    """Within the block, `optimizer.apply` updates (and decays) a variable only where
    `keep(key)` holds, `key` being the variable's key in the optimizer (`var_key`):
    a boolean tensor, decided at run time.

    Keras leaves a variable whose gradient is None out of an update (no step, no
    slot change, no weight decay); which variables a window updates is known only
    when it closes, so each variable's step runs under a `tf.cond`. Keras calls
    `update_step` and `_apply_weight_decay` once per variable (per device under a
    strategy), with the variable or a replica's copy of it.
    """
    update_step = optimizer.update_step
    apply_weight_decay = optimizer._apply_weight_decay

    def masked_step(gradient, variable, learning_rate):
        def step():
            update_step(gradient, variable, learning_rate)
            return tf.constant(True)

        tf.cond(keep(var_key(optimizer, variable)), step, lambda: tf.constant(False))

    def masked_decay(variables):
        for variable in variables:

            def decay(variable=variable):
                apply_weight_decay([variable])
                return tf.constant(True)

            tf.cond(keep(var_key(optimizer, variable)), decay, lambda: tf.constant(False))

    with overriding(optimizer, update_step=masked_step, _apply_weight_decay=masked_decay):
        yield


def multi_worker(strategy) -> bool:
    """Whether `strategy` is a MultiWorkerMirroredStrategy with several workers (the
    test Keras's TensorFlow trainer makes before reducing a step's logs)."""
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


@contextlib.contextmanager
def built_before_tracing(model):
    """Within the block (a `fit`, a `train_on_batch`), Keras's TensorFlow trainer
    builds a model that is not built yet before it makes the train function, as the
    JAX and PyTorch trainers always do, from the shapes and dtypes of the data.

    Without a strategy Keras defers the build into the first trace of its step
    (`_maybe_symbolic_build`), so a `Sequential` with no `keras.Input` has no
    variables when the function is made; gradaccum's accumulators need them then.
    The build reads the dataset's `element_spec` (no batch is read, so a shuffle's
    order, a one-shot generator and a stateful `map` see what plain Keras gives
    them) and calls the model symbolically with `training=True`, as the step's
    first trace would (a layer used only in training is built too; ragged and
    sparse inputs stay so). The compiled loss and metrics are built in the traced
    step, as Keras builds them without a strategy; gradaccum builds the optimizer
    before tracing. A model that cannot be called symbolically, or data with no
    batch, leaves the model unbuilt: the state's check then says how to build it.
    """
    keras_build = model._maybe_symbolic_build

    def symbolic(spec):
        if spec is None:
            return None
        return keras.KerasTensor(
            spec.shape, keras.backend.standardize_dtype(spec.dtype),
            sparse=isinstance(spec, tf.SparseTensorSpec),
            ragged=isinstance(spec, tf.RaggedTensorSpec))

    def symbolic_build(iterator=None, data_batch=None):
        if model._distribute_strategy is not None or all(
                layer.built for layer in model._flatten_layers()):
            return keras_build(iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            data_batch = iterator._distributed_dataset.element_spec
        elif data_batch is not None:
            data_batch = tf.nest.map_structure(
                lambda v: None if v is None else tf.type_spec_from_value(v), data_batch)
        if data_batch is None:
            return None
        x, _, _ = keras.utils.unpack_x_y_sample_weight(
            tf.nest.map_structure(symbolic, data_batch))
        try:
            compute_output_spec(model, x, training=True)
        except Exception:  # noqa: BLE001 (the state's check names the way out)
            pass

    with overriding(model, _maybe_symbolic_build=symbolic_build):
        yield


# The key under which a step's scalar logs travel packed under several workers.
PACKED_LOGS = "gradaccum_packed_logs"


@contextlib.contextmanager
def across_workers(model):
    """Within the block (a `fit` or `evaluate`), Keras 3.15's trainer runs under a
    strategy with several replicas, MultiWorkerMirroredStrategy included; elsewhere
    it does nothing.

    Two Keras failures (keras-team/keras issue 20585; tensorflow/tensorflow issue
    72388), both in keras/src/backend/tensorflow/trainer.py:

    - `_maybe_symbolic_build` averages the first batch across replicas with
      `strategy.reduce("MEAN", (x, y), axis=None)`, which MultiWorkerMirroredStrategy
      cannot do on a nested structure ("Attempt to convert a value (PerReplica...)")
      and no strategy can do on a boolean tensor (a KerasHub task's padding mask under
      MirroredStrategy: "Value for attr 'T' of bool"). The build needs shapes and
      dtypes only: it is given this worker's first replica's batch.
    - `reduce_per_replica` reduces each log with `strategy.reduce("MEAN", v,
      axis=0)`, which fails on the scalar logs every step returns ("Invalid
      reduction dimension 0 for input with 0 dimensions"), and would make one
      all-reduce per log and step. The step's logs are packed into one [1, n]
      float64 tensor, which Keras averages across replicas in one all-reduce, and
      the train (test) function unpacks them (shapes and dtypes restored): the
      replicas' mean, as under MirroredStrategy (multi-worker only).

    Re-entrant (validation inside `fit` calls `evaluate`); the functions made inside
    keep unpacking after the block.
    """
    strategy = model.distribute_strategy
    several = strategy.num_replicas_in_sync > 1 or multi_worker(strategy)
    if not several or model.__dict__.get("_gradaccum_across_workers"):
        yield
        return

    def symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v,
                    next(batches),
                )
                break
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    overrides = {"_maybe_symbolic_build": symbolic_build}
    for kind in ("train", "test") if multi_worker(strategy) else ():
        structure = []  # the logs' structure, learnt when the step is traced
        step = getattr(model, f"{kind}_step")
        make = getattr(model, f"make_{kind}_function")
        overrides[f"{kind}_step"] = _packing_logs(step, structure)
        overrides[f"make_{kind}_function"] = _unpacking_logs(model, kind, make, structure)
    model.__dict__["_gradaccum_across_workers"] = True
    try:
        with overriding(model, **overrides):
            yield
    finally:
        del model.__dict__["_gradaccum_across_workers"]


def _packing_logs(step, structure):
    """`step` with its logs packed: every tensor of the logs flattened into one
    float64 [1, n] tensor (exact for float32 and float64 logs and for integers
    below 2^53); `structure` learns the logs' structure, shapes and dtypes when the
    step is traced."""

    def packed(data):
        logs = step(data)
        leaves = tf.nest.flatten(logs)
        if not leaves or not all(
            tf.is_tensor(t) and t.shape.is_fully_defined() for t in leaves
        ):
            # Anything else: scalars get the axis Keras reduces over.
            return tf.nest.map_structure(
                lambda t: tf.reshape(t, [1]) if tf.is_tensor(t) and t.shape.rank == 0 else t,
                logs,
            )
        structure[:] = [(logs, [t.shape for t in leaves], [t.dtype for t in leaves])]
        values = tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in leaves], 0)
        return {PACKED_LOGS: tf.reshape(values, [1, -1])}

    return packed


def _unpacking_logs(model, kind, make, structure):
    name = f"{kind}_function"

    def unpacking(function):
        if getattr(function, "gradaccum_unpacks", False):
            return function

        def run(iterator):
            logs = function(iterator)
            if not (isinstance(logs, dict) and PACKED_LOGS in logs and structure):
                return logs
            template, shapes, dtypes = structure[0]
            values = tf.split(
                tf.reshape(logs[PACKED_LOGS], [-1]), [s.num_elements() for s in shapes]
            )
            leaves = [
                tf.cast(tf.reshape(v, shape), dtype)
                for v, shape, dtype in zip(values, shapes, dtypes)
            ]
            return tf.nest.pack_sequence_as(template, leaves)

        run.gradaccum_unpacks = True
        return run

    def make_function(force=False):
        made = getattr(model, name)
        # A function made outside the block (e.g. by `train_on_batch`) has Keras's
        # failing reduction: made again.
        stale = made is not None and not getattr(made, "gradaccum_unpacks", False)
        make(force=force or stale)
        function = unpacking(getattr(model, name))
        setattr(model, name, function)
        return function

    return make_function


def apply_gradients(optimizer, pairs) -> None:
    """`optimizer.apply_gradients(pairs)` as its class defines it: gradaccum's own
    update goes past the redirect that `gradaccum.accumulate` sets on a model's
    optimizers while its train_step runs (a public method, reached on the class).
    A sparse gradient's repeated rows are summed first (`sums.deduplicated`)."""
    grads, variables = zip(*pairs) if pairs else ((), ())
    type(optimizer).apply(optimizer, [deduplicated(g) for g in grads], list(variables))


def var_key(optimizer, variable):
    """The key under which `optimizer` knows `variable` (a replica's copy included)."""
    return optimizer._var_key(variable)


__all__ = [
    "PRIVATE_PIECES",
    "add_replica_local_weight",
    "batch_norm_moments",
    "batch_norm_reduction_axes",
    "call_has_training_arg",
    "compile_config",
    "compiled_loss",
    "set_compile_config",
    "compute_loss",
    "loss_tracker",
    "missing_pieces",
    "multi_worker",
    "optimizer_variables_of",
    "own_variables",
    "flatten_layers",
    "is_loss_scale_optimizer",
    "is_optimizer",
    "Functional",
    "LossFunctionWrapper",
    "count_compiled_losses",
    "apply_mask",
    "get_keras_mask",
    "across_workers",
    "applying_across_replicas",
    "apply_gradients",
    "tf_variable",
    "updating_only",
    "var_key",
    "squeeze_or_expand_to_same_rank",
    "unscale_loss_for_distribution",
]
