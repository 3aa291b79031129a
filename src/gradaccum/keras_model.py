"""The Keras `fit()` integration: `wrap(model, steps=k)`.

`AccumulatingModel` trains the wrapped model's own variables. Each `train_step` is
one micro-batch: forward, backward of the loss scaled by the micro-batch's weight,
`GradientAccumulator.accumulate_weighted`, and an update when the window is full or
the epoch's data ends (partial windows, by policy). All of it runs inside the compiled train
function: no host round trip and no Python work per micro-batch.

Under tf.distribute each replica's `train_step` accumulates its own share of the
micro-batch; the accumulator reduces across replicas once per update. The
fit-position counters are replica-local too, so a micro-batch costs no
communication.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from gradaccum import _keras_compat as kc
from gradaccum import batch_norm
from gradaccum._validation import check_choice, check_steps
from gradaccum.accumulator import (
    NONFINITE,
    REDUCTIONS,
    GradientAccumulator,
    _Untracked,
    check_accumulator_dtype,
    check_loss_scaling_replicas,
    check_optimizer,
    distribution_of,
)
from gradaccum.batch_norm import convert_batch_normalization
from gradaccum.weighting import (
    NormalizerLog,
    callable_weight,
    check_weighting,
    record_normalizers,
)

PARTIALS = ("flush", "carry", "drop")


class _Readout(keras.metrics.Metric):
    """Shows a counter of the trainer in the logs of fit (nothing to accumulate)."""

    def __init__(self, trainer, name, read):
        super().__init__(name=name)
        self._trainer = _Untracked(trainer)
        self._read = read

    def update_state(self, *args, **kwargs):
        pass

    def reset_state(self):
        pass

    def result(self):
        value = self._read(self._trainer.value)
        return tf.constant(0.0) if value is None else tf.cast(value, tf.float32)


def _optimizer_updates(trainer):
    """The optimizer's update count (`iterations`)."""
    return None if trainer.optimizer is None else trainer.optimizer.iterations


def _skipped_micro_batches(trainer):
    """Micro-batches skipped for a non-finite gradient."""
    state = trainer._fit_state
    return None if state is None else state.accumulator.skipped


class _FitState(tf.Module):
    """Accumulation state of fit: the accumulator and the epoch position."""

    def __init__(self, variables, steps, reduction, accumulator_dtype, terms=0, layers=None,
                 nonfinite="skip"):
        super().__init__(name="gradaccum_fit_state")
        self.accumulator = GradientAccumulator(
            variables,
            steps=steps,
            reduction=reduction,
            accumulator_dtype=accumulator_dtype,
            layers=layers,
            nonfinite=nonfinite,
        )
        # Replica-local (every replica counts the same micro-batches): updating
        # them inside a replica's step needs no communication.
        local = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        int64 = dict(local, dtype=tf.int64)
        # Micro-batches seen in the current epoch, its length (-1: unknown), and
        # micro-batches to skip after a restore in the middle of an epoch.
        self.epoch_step = tf.Variable(0, name="epoch_step", **int64)
        self.epoch_length = tf.Variable(-1, name="epoch_length", **int64)
        self.resume_skip = tf.Variable(0, name="resume_skip", **int64)
        # Several loss terms: their normalizer ratios at the window's start, and
        # whether a window had ratios that differ (then one weight is not exact).
        self.term_ratios = tf.Variable(
            tf.zeros([terms], tf.float32), name="term_ratios", **local
        )
        self.inexact = tf.Variable(False, name="inexact", **local)

    def saved_variables(self) -> dict[str, tf.Variable]:
        acc = self.accumulator
        named = {f"accumulator_{i}": v for i, v in enumerate(acc.accumulators)}
        named.update(
            micro_step=acc.micro_step,
            total_weight=acc.total_weight,
            window_skipped=acc._window_skipped,
            skipped=acc.skipped,
            micro_batches=acc.micro_batches,
            epoch_step=self.epoch_step,
            resume_skip=self.resume_skip,
        )
        for i, layer in enumerate(acc.batch_normalization_layers):
            named.update(
                {
                    f"batch_norm_{i}_window_count": layer.window_count,
                    f"batch_norm_{i}_window_mean": layer.window_mean,
                    f"batch_norm_{i}_window_m2": layer.window_m2,
                }
            )
        return named


class _EpochHook(keras.callbacks.Callback):
    """Runs first among fit's callbacks: epoch position and end-of-data windows."""

    def __init__(self, trainer):
        super().__init__()
        self._trainer = _Untracked(trainer)
        self._first_epoch = True
        self._calls = 0
        self._skipped_before = 0

    def on_train_begin(self, logs=None):
        steps = (self.params or {}).get("steps")
        self._trainer.value._fit_state.epoch_length.assign(steps if steps else -1)
        self._first_epoch = True
        self._calls = 0
        self._skipped_before = int(self._trainer.value._fit_state.accumulator.skipped.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self._calls += 1
        trainer = self._trainer.value
        if trainer.nonfinite == "raise" and trainer.jit_compile:
            # XLA compiles the step's assertion away (the micro-batch is skipped
            # instead): raise here, after the compiled call.
            skipped = int(trainer._fit_state.accumulator.skipped.numpy())
            skipped -= self._skipped_before
            if skipped:
                raise tf.errors.InvalidArgumentError(
                    None,
                    None,
                    f"gradaccum: a gradient is not finite (inf or nan) in {skipped} "
                    "micro-batch(es) of this compiled call (jit_compile: the micro-batch "
                    "was skipped, and the error is raised after the call): "
                    "nonfinite=raise stops here. Check the data and the loss, or use "
                    "nonfinite=skip to drop such micro-batches.",
                )

    def on_epoch_begin(self, epoch, logs=None):
        state = self._trainer.value._fit_state
        if self._first_epoch and int(state.epoch_step.numpy()) > 0:
            # Restored (BackupAndRestore) in the middle of an epoch: the epoch
            # restarts from its first batch, so skip what was already trained on.
            state.resume_skip.assign(state.epoch_step)
        state.epoch_step.assign(0)
        self._first_epoch = False

    def on_epoch_end(self, epoch, logs=None):
        trainer = self._trainer.value
        trainer._end_of_data()
        trainer._fit_state.epoch_step.assign(0)
        if logs is not None and "updates" in logs:
            logs["updates"] = float(trainer.optimizer.iterations.numpy())
        if logs is not None and "skipped" in logs:
            logs["skipped"] = float(trainer._fit_state.accumulator.skipped.numpy())
        trainer._warn_if_inexact()
        trainer._warn_if_skipped()

    def on_train_end(self, logs=None):
        self._trainer.value._end_of_data()
        if self._calls == 0 and (self.params or {}).get("epochs", 1) > 0:
            raise ValueError(
                "`fit` must receive at least one micro-batch. Received: data that "
                "yielded no batch (an empty dataset or array), so nothing was "
                "accumulated or applied."
            )


@keras.saving.register_keras_serializable(package="gradaccum")
class AccumulatingModel(keras.Model):
    """A `keras.Model` that trains `model` with exact gradient accumulation.

    Created by `gradaccum.wrap`; see there for the arguments. `trainer.model` is the
    wrapped model: it holds the trained weights, and `trainer.model.save()` writes a
    plain Keras model (one that needs gradaccum to load if it holds
    `gradaccum.BatchNormalization` layers).

    Raises:
        ValueError: as `gradaccum.wrap`.

    Example:

    >>> import keras, numpy as np, gradaccum
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> trainer = gradaccum.AccumulatingModel(model, steps=2, partial="drop")
    >>> trainer.compile(optimizer="sgd", loss="mse")
    >>> history = trainer.fit(np.ones((10, 2)), np.ones((10, 1)), batch_size=2, verbose=0)
    >>> int(trainer.optimizer.iterations)  # 5 micro-batches: 2 windows, 1 dropped
    2
    >>> trainer.model is model
    True
    """

    def __init__(
        self,
        model,
        *,
        steps: int,
        weighting="exact",
        partial: str = "flush",
        reduction: str = "mean",
        accumulator_dtype="float32",
        convert_batch_norm: bool = False,
        nonfinite: str = "skip",
        **kwargs,
    ):
        if not isinstance(model, keras.Model):
            raise ValueError(
                "`model` must be a keras.Model. "
                f"Received: model={model!r} of type {type(model).__name__}"
            )
        if isinstance(model, AccumulatingModel):
            raise ValueError(
                "`model` must be a keras.Model that is not already wrapped. "
                f"Received: model={model.name!r}, a gradaccum AccumulatingModel; "
                "wrap its `.model` instead."
            )
        if not isinstance(convert_batch_norm, bool):
            raise ValueError(
                "`convert_batch_norm` must be True or False. "
                f"Received: convert_batch_norm={convert_batch_norm!r}"
            )
        if convert_batch_norm:
            model = convert_batch_normalization(model)
        if model.built:
            distribution_of(model.trainable_variables)
        kwargs.setdefault("name", f"gradaccum_{model.name}")
        super().__init__(**kwargs)
        self.model = model
        self.steps = check_steps(steps)
        self.weighting = check_weighting(weighting)
        self.partial = check_choice("partial", partial, PARTIALS)
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)
        self.accumulator_dtype = check_accumulator_dtype(accumulator_dtype).name
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE)
        self._normalizers = NormalizerLog()
        self._updates = _Readout(self, "updates", _optimizer_updates)
        self._skips = _Readout(self, "skipped", _skipped_micro_batches)
        self._fit_state = None
        self._end_of_data_function = None
        self._inexact_warned = False
        self._resumable = False
        if model.built:
            self.built = True

    # Keras model protocol --------------------------------------------------------

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def compile(self, optimizer="rmsprop", loss=None, *args,
                steps_per_execution="window", **kwargs):
        """Configures training as `keras.Model.compile`, with one difference.

        `steps_per_execution` defaults to `"window"`: one compiled call runs the
        `steps` micro-batches of a window (batch-level callbacks then see windows, as
        with any `steps_per_execution`). Pass an integer (1 for per-micro-batch
        callbacks) to choose. Under a tf.distribute strategy with several replicas
        `"window"` means 1: Keras's multi-step train function fails there (keras
        issue 19246, "You must feed a value for placeholder tensor").
        """
        if steps_per_execution == "window":
            replicas = self.distribute_strategy.num_replicas_in_sync
            steps_per_execution = self.steps if replicas == 1 else 1
        optimizer = keras.optimizers.get(optimizer)
        check_optimizer(optimizer)
        if self.weighting == "exact":
            loss = record_normalizers(loss, self._normalizers)
        super().compile(optimizer, loss, *args, steps_per_execution=steps_per_execution,
                        **kwargs)
        # Keras wraps the optimizer in a LossScaleOptimizer under mixed_float16.
        if kc.is_loss_scale_optimizer(self.optimizer):
            check_loss_scaling_replicas(self.distribute_strategy)
        self._fit_state = None
        self._end_of_data_function = None

    @property
    def metrics(self):
        metrics = super().metrics
        if self.nonfinite == "apply" and not (
            self.optimizer is not None and kc.is_loss_scale_optimizer(self.optimizer)
        ):
            # Nothing can be skipped: no counter to show.
            metrics = [m for m in metrics if m is not self._skips]
        return metrics

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        weighting = self.weighting
        if callable(weighting):
            weighting = keras.saving.serialize_keras_object(weighting)
        return {
            "model": keras.saving.serialize_keras_object(self.model),
            "steps": self.steps,
            "weighting": weighting,
            "partial": self.partial,
            "reduction": self.reduction,
            "accumulator_dtype": self.accumulator_dtype,
            # The saved model holds the converted layers already.
            "convert_batch_norm": False,
            "nonfinite": self.nonfinite,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        weighting = config.pop("weighting")
        if not isinstance(weighting, str):
            weighting = keras.saving.deserialize_keras_object(
                weighting, custom_objects=custom_objects
            )
        return cls(model, weighting=weighting, **config)

    def make_train_function(self, force=False):
        self._ensure_fit_state()
        return super().make_train_function(force=force)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, **kwargs):
        hook = _EpochHook(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.insert(0, hook)
            listed = callbacks.callbacks
        else:
            callbacks = [hook, *(callbacks or [])]
            listed = callbacks
        resumable = any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in listed)
        if resumable != self._resumable:
            # The step that can skip restored micro-batches costs a branch per
            # micro-batch: compile it only for fits that can restore.
            self._resumable = resumable
            self.train_function = None
        if self._fit_state is not None:
            # A new fit starts at an epoch's beginning; BackupAndRestore may then
            # restore a position inside an epoch.
            self._fit_state.epoch_step.assign(0)
            self._fit_state.resume_skip.assign(0)
        return super().fit(
            x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=callbacks, **kwargs,
        )

    def evaluate(self, *args, **kwargs):
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit sees the epoch's partial window applied.
            self._end_of_data()
        return super().evaluate(*args, **kwargs)

    def train_step(self, data):
        if not self._resumable:
            return self._micro_batch_step(data)
        # Under BackupAndRestore a fit may restart inside an epoch and must skip the
        # micro-batches already trained on. The training branch is traced first: it
        # builds the metrics that the skipping branch reports.
        return tf.cond(
            self._fit_state.resume_skip <= 0,
            lambda: self._micro_batch_step(data),
            self._skip_micro_batch,
        )

    def test_step(self, data):
        logs = super().test_step(data)
        logs.pop(self._updates.name, None)
        logs.pop(self._skips.name, None)
        return logs

    # Saving: the accumulation state travels with the weights ---------------------

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if self._fit_state is not None:
            for key, variable in self._fit_state.saved_variables().items():
                store[f"gradaccum_{key}"] = variable.numpy()

    def load_own_variables(self, store):
        keys = set(store.keys())
        ours = {k for k in keys if k.startswith("gradaccum_")}
        if ours:
            self._ensure_fit_state()
            for key, variable in self._fit_state.saved_variables().items():
                if f"gradaccum_{key}" in keys:
                    variable.assign(store[f"gradaccum_{key}"])
        super().load_own_variables({k: store[k] for k in keys - ours})

    # Internals ---------------------------------------------------------------

    def _ensure_fit_state(self):
        if self._fit_state is not None:
            return
        if not self.model.built:
            raise ValueError(
                "The wrapped model must be built before its accumulation state is "
                f"created. Received: model {self.model.name!r} that is not built "
                "(fit builds it from its first batch: is the data empty?). Give the "
                "model an Input, or call it on a batch first."
            )
        if not self.trainable_variables:
            raise ValueError(
                "The wrapped model must have trainable variables to accumulate "
                f"gradients of. Received: model {self.model.name!r} with none."
            )
        terms = max(0, kc.count_compiled_losses(getattr(self, "_compile_loss", None)) - 1)
        with self.distribute_strategy.scope():
            distribution_of(self.trainable_variables)
            if self.optimizer is not None and not self.optimizer.built:
                # Before tracing: a loss scale read in the step must be a variable.
                self.optimizer.build(self.trainable_variables)
            self._fit_state = _FitState(
                self.trainable_variables,
                self.steps,
                self.reduction,
                self.accumulator_dtype,
                terms=terms,
                layers=self.model,
                nonfinite=self.nonfinite,
            )
        # The layers record only inside this model's training step (see
        # `_micro_batch_step`): elsewhere they stay Keras's layer.
        for layer in self._fit_state.accumulator.batch_normalization_layers:
            layer._accumulated = False

    def _skip_micro_batch(self):
        state = self._fit_state
        state.resume_skip.assign_sub(1)
        state.epoch_step.assign_add(1)
        return self.get_metrics_result()

    def _micro_batch_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        state = self._fit_state
        acc = state.accumulator
        variables = list(acc.target_variables)
        self._normalizers.take()
        distributed = tf.distribute.has_strategy()
        loss_scaled = kc.is_loss_scale_optimizer(self.optimizer)
        # A window of one micro-batch on one device: G = w g / w = g, applied
        # without the accumulators' copy.
        single = self.steps == 1 and not (
            distributed or loss_scaled or acc.batch_normalization_layers
        )
        # With reduction "mean", differentiate w_i * L_i: the weight is applied once to
        # the loss rather than to every gradient. Under tf.distribute, L_i is the
        # replica's own loss (Keras divides it by the replica count: undone here),
        # so that the reduced sums give the global window's gradient exactly. Under
        # loss scaling the weight is applied with the unscaling instead, so that the
        # scaled loss is what Keras would scale (no extra overflows).
        weigh_loss = self.reduction == "mean" and not (single or loss_scaled)
        with tf.GradientTape() as tape, batch_norm.driving(acc.batch_normalization_layers):
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            weight = tf.stop_gradient(self._micro_batch_weight(x, y, sample_weight))
            objective = loss
            if weigh_loss:
                objective = kc.unscale_loss_for_distribution(loss) * tf.cast(
                    weight, loss.dtype
                )
            # Loss scaling (a LossScaleOptimizer's dynamic scale, or an optimizer's
            # static `loss_scale_factor`), as Keras's own train step does.
            objective = self.optimizer.scale_loss(objective)
        gradients = tape.gradient(objective, variables)
        self._loss_tracker.update_state(
            kc.unscale_loss_for_distribution(loss), sample_weight=weight
        )
        state.epoch_step.assign_add(1)
        if single:
            acc._apply_single(self.optimizer, gradients)
        elif loss_scaled:
            # Unscaled and weighed in one multiply by the accumulator.
            acc.accumulate(gradients, weight, loss_scale_optimizer=self.optimizer)
            self._close_window_if_due()
        else:
            acc.accumulate_weighted(gradients, weight)
            self._close_window_if_due()
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _micro_batch_weight(self, x, y, sample_weight):
        if self.weighting == "uniform":
            return tf.constant(1.0)
        if callable(self.weighting):
            return callable_weight(self.weighting, x, y, sample_weight)
        normalizers = self._normalizers.take()
        if not normalizers:
            self._warn_no_compiled_loss()
            first = next(t for t in tf.nest.flatten(x) if t is not None)
            return tf.cast(tf.shape(first)[0], tf.float32)
        if len(normalizers) > 1:
            self._track_term_ratios(normalizers)
        return normalizers[0]

    def _track_term_ratios(self, normalizers):
        state = self._fit_state
        ratios = tf.stack([tf.math.divide_no_nan(n, normalizers[0]) for n in normalizers[1:]])
        first_in_window = state.accumulator.micro_step == 0
        differs = tf.reduce_any(
            tf.abs(ratios - state.term_ratios) > 1e-6 * tf.abs(state.term_ratios)
        )
        state.inexact.assign(
            tf.logical_or(state.inexact, tf.logical_and(~first_in_window, differs))
        )
        state.term_ratios.assign(tf.where(first_in_window, ratios, state.term_ratios))

    def _close_window_if_due(self):
        state = self._fit_state
        acc = state.accumulator
        end_of_data = tf.logical_and(
            state.epoch_length > 0, state.epoch_step >= state.epoch_length
        )
        full = acc.window_length() >= self.steps
        if self.partial == "flush":
            acc.apply_if(self.optimizer, tf.logical_or(full, end_of_data))
        else:
            acc.apply_if(self.optimizer, full)
            if self.partial == "drop":
                tf.cond(end_of_data, self._drop_window, lambda: tf.constant(False))

    def _drop_window(self):
        self._fit_state.accumulator.reset()
        return tf.constant(True)

    def _end_of_data(self):
        """Closes the open window as `partial` says (idempotent)."""
        if self._fit_state is None or self.partial == "carry":
            return
        if self._end_of_data_function is None:
            acc = self._fit_state.accumulator
            if self.partial == "flush":
                def close():
                    return acc.apply(self.optimizer)
            else:
                def close():
                    # A window of only skipped micro-batches is closed too.
                    return tf.cond(acc.window_length() > 0, self._drop_window,
                                   lambda: tf.constant(False))
            self._end_of_data_function = close if self.run_eagerly else tf.function(close)
        with self.distribute_strategy.scope():
            self._end_of_data_function()

    def _warn_if_inexact(self):
        state = self._fit_state
        if state is None or self._inexact_warned or not bool(state.inexact.numpy()):
            return
        self._inexact_warned = True
        warnings.warn(
            "weighting='exact' is approximate for this model: its loss terms have "
            "normalizers that are not proportional across the micro-batches of a "
            "window (e.g. outputs with their own masks), so one weight per "
            "micro-batch cannot reproduce the large-batch loss. Use equal "
            "micro-batches, or a `weighting` callable for your normalizer.",
            stacklevel=2,
        )

    def _warn_if_skipped(self):
        state = self._fit_state
        if state is None or self.nonfinite != "skip":
            return
        if kc.is_loss_scale_optimizer(self.optimizer):
            return  # loss scaling skips overflowing micro-batches by design
        skipped = int(state.accumulator.skipped.numpy())
        if skipped:
            state.accumulator._warn_skipped(skipped, stacklevel=3)

    def _warn_no_compiled_loss(self):
        warnings.warn(
            "weighting='exact' found no compiled loss (only `add_loss` terms): "
            "micro-batches are weighted by their size.",
            stacklevel=2,
        )


def wrap(
    model,
    steps: int,
    *,
    weighting="exact",
    partial: str = "flush",
    reduction: str = "mean",
    accumulator_dtype="float32",
    convert_batch_norm: bool = False,
    nonfinite: str = "skip",
) -> AccumulatingModel:
    """Wraps a Keras model so that `fit()` trains it with gradient accumulation.

    Each batch of `fit` is a micro-batch; every `steps` micro-batches the optimizer
    makes one update with their combined gradient. The update equals one step on
    the concatenated window (with `weighting="exact"`), and the optimizer's
    iterations, learning-rate schedule, clipping, weight decay and EMA count updates.

    Args:
        model: the `keras.Model` to train. The returned model shares its variables:
            after `fit`, `model` holds the trained weights.
        steps: micro-batches per update (k).
        weighting: `"exact"` (default): each micro-batch weighs its loss normalizer
            (its number of loss elements, unmasked elements, or sample-weight sum),
            so unequal micro-batches, sample and class weights, masks and unequal
            sequence lengths give the large-batch gradient. `"uniform"`: the plain
            mean (as Keras's built-in accumulation). Or a callable
            `(x, y, sample_weight) -> weight` returning a scalar >= 0.
        partial: what happens to a window the data ends in the middle of (end of an
            epoch and of fit): `"flush"` (default) applies it normalized by its own
            weight, `"carry"` keeps it open into the next epoch, `"drop"` discards it.
        reduction: `"mean"` (default) or `"sum"` (sum of the micro-batch gradients).
        accumulator_dtype: dtype of the accumulators (float32 by default).
        convert_batch_norm: if True, train a copy of `model` whose Keras
            `BatchNormalization` layers are `gradaccum.BatchNormalization` (gamma,
            beta and moving statistics carried over; see
            `gradaccum.convert_batch_normalization`): moving statistics then move
            once per update from the window's statistics. `trainer.model` is that
            copy, and `model` is left untouched. Without it, layers that already are
            `gradaccum.BatchNormalization` are driven by the accumulator anyway.
        nonfinite: a micro-batch whose gradient holds an inf or a nan is
            `"skip"`ped (default: dropped with its weight, counted in the logs'
            `skipped`, a warning once), makes fit `"raise"` an error naming it, or
            is `"apply"`ed as Keras would.

    Mixed precision: under the `mixed_float16` policy Keras wraps the optimizer in a
    `LossScaleOptimizer`; a micro-batch whose gradient is not finite is then skipped
    with its weight, the loss scale backs off, and the logs show `skipped`.

    Returns:
        An `AccumulatingModel` to `compile` and `fit` like any Keras model. Its logs
        include `updates`, the optimizer's update count.

    Raises:
        ValueError: if `model` is not a Keras model, or on an invalid `steps`,
            `weighting`, `partial`, `reduction`, `accumulator_dtype`,
            `convert_batch_norm` or `nonfinite`, or (with `convert_batch_norm`) a subclassed model
            or a BatchNormalization option that cannot be honoured.

    Example:

    >>> import keras, numpy as np, gradaccum
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> trainer = gradaccum.wrap(model, steps=4)
    >>> trainer.compile(optimizer="adam", loss="mse")
    >>> x, y = np.ones((100, 4)), np.zeros((100, 1))
    >>> history = trainer.fit(x, y, batch_size=8, epochs=2, verbose=0)
    >>> history.history["updates"]  # 13 micro-batches per epoch: 3 windows + 1 partial
    [4.0, 8.0]
    >>> int(trainer.optimizer.iterations)
    8
    """
    return AccumulatingModel(
        model,
        steps=steps,
        weighting=weighting,
        partial=partial,
        reduction=reduction,
        accumulator_dtype=accumulator_dtype,
        convert_batch_norm=convert_batch_norm,
        nonfinite=nonfinite,
    )
