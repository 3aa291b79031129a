"""Accumulation inside Keras's `fit()`: one mechanism for both doors.

`Accumulation` attaches to the model being trained (the *host*): the user's own
model (`gradaccum.accumulate`) or `wrap`'s `AccumulatingModel`. It holds the
options, the accumulation state and the training step:

- a host that uses Keras's default `train_step` trains with gradaccum's exact step:
  forward, the host's own loss (`compute_loss`, compiled loss, regularizers),
  backward of the loss weighted by the micro-batch's normalizer, accumulation, and
  an update when the window closes;
- a host whose class defines its own `train_step` runs it unchanged; accumulation
  sits where it hands gradients to an optimizer (`apply_gradients` / `apply`), one
  accumulator per optimizer and variable list, each applied once per window.

Epoch positions, the end of the data (the window policy of `_window`), resuming
under `BackupAndRestore` and the `updates`/`skipped` log entries are kept by a
callback that runs first among `fit`'s callbacks.
"""

from __future__ import annotations

import threading

import keras
import numpy as np
import tensorflow as tf

from gradaccum import _fit_common, batch_norm
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import retry as _retry
from gradaccum.backends.tensorflow import split as _split
from gradaccum.backends.tensorflow import window as _window
from gradaccum.backends.tensorflow.accumulator import GradientAccumulator
from gradaccum.backends.tensorflow.distributed import (
    COUNTED,
    check_split_synchronization,
    distribution_of,
)
from gradaccum.backends.tensorflow.screening import compiled_raise_message
from gradaccum.backends.tensorflow.state import Untracked
from gradaccum.core.options import Options as CoreOptions
from gradaccum.weighting import NEGATIVE_WEIGHT, NormalizerLog, callable_weight

PARTIALS = _window.PARTIALS


class Options(CoreOptions):
    """The checked options (`gradaccum.core.options.Options`) with TensorFlow's
    window rule (a schedule's callable runs as a `tf.function`) and accumulators."""

    window_rule = _window.WindowRule

    def accumulator(self, variables, *, layers=None, name="gradient_accumulator"):
        return GradientAccumulator(
            variables,
            steps=self.window,
            reduction=self.reduction,
            accumulator_dtype=self.accumulator_dtype,
            layers=layers,
            nonfinite=self.nonfinite,
            name=name,
        )


class FitState(tf.Module):
    """Accumulation state of fit: the accumulators and the epoch position."""

    def __init__(self, accumulator=None, terms=0):
        super().__init__(name="gradaccum_fit_state")
        # The exact step's accumulator (None for a model's own train_step).
        self.accumulator = accumulator
        # A model's own step: one accumulator per (optimizer, variables), in the
        # order the step first handed them gradients.
        self.own = []
        # Replica-local (every replica counts the same micro-batches): updating
        # them inside a replica's step needs no communication.
        int64 = dict(COUNTED, dtype=tf.int64)
        # Micro-batches seen in the current epoch, its length (-1: unknown), and
        # micro-batches to skip after a restore in the middle of an epoch.
        self.epoch_step = tf.Variable(0, name="epoch_step", **int64)
        self.epoch_length = tf.Variable(-1, name="epoch_length", **int64)
        self.resume_skip = tf.Variable(0, name="resume_skip", **int64)
        # Several loss terms: their normalizer ratios at the window's start, and
        # whether a window had ratios that differ (then one weight is not exact).
        self.term_ratios = tf.Variable(
            tf.zeros([terms], tf.float32), name="term_ratios", **COUNTED
        )
        self.inexact = tf.Variable(False, name="inexact", **COUNTED)
        # Split mode: the micro-batch size the step uses ("auto" changes it between
        # calls without a retrace), and whether the step got as far as applying
        # (a step that failed after that point cannot be retried).
        self.micro_batch_size = tf.Variable(1, name="micro_batch_size", **int64)
        self.applying = tf.Variable(False, name="applying", **COUNTED)

    def accumulators(self) -> list:
        """Every accumulator with the optimizer it applies with."""
        return ([] if self.accumulator is None else [self.accumulator]) + [
            acc for acc, _ in self.own
        ]

    @property
    def skipped(self) -> int:
        return sum(int(acc.skipped.numpy()) for acc in self.accumulators())

    def saved_variables(self) -> dict[str, tf.Variable]:
        named = {} if self.accumulator is None else self.accumulator.state_variables()
        for j, (acc, _) in enumerate(self.own):
            named.update({f"own_{j}_{k}": v for k, v in acc.state_variables().items()})
        named.update(epoch_step=self.epoch_step, resume_skip=self.resume_skip)
        return named


class EpochHook(keras.callbacks.Callback):
    """Runs first among fit's callbacks: epoch position, end-of-data windows and the
    `updates`/`skipped` log entries."""

    def __init__(self, accumulation):
        super().__init__()
        self._accumulation = Untracked(accumulation)
        self._first_epoch = True
        self._calls = 0
        self._skipped_before = 0
        # Batches per epoch, as Keras's epoch iterator counts them (None: unknown).
        self.epoch_length = None
        # Whether this fit has epochs to run (epochs > initial_epoch).
        self.epochs_to_run = True

    @property
    def _state(self):
        return self._accumulation.value.state

    def on_train_begin(self, logs=None):
        steps = self.epoch_length
        self._state.epoch_length.assign(steps if steps else -1)
        self._first_epoch = True
        self._calls = 0
        self._skipped_before = self._state.skipped

    def on_train_batch_end(self, batch, logs=None):
        self._calls += 1
        accumulation = self._accumulation.value
        host = accumulation.host
        if accumulation.options.nonfinite == "raise" and host.jit_compile:
            # XLA compiles the step's assertion away (the micro-batch is skipped
            # instead): raise here, after the compiled call.
            skipped = self._state.skipped - self._skipped_before
            if skipped:
                raise tf.errors.InvalidArgumentError(
                    None, None, compiled_raise_message(skipped)
                )

    def on_epoch_begin(self, epoch, logs=None):
        state = self._state
        if self._first_epoch and int(state.epoch_step.numpy()) > 0:
            # Restored (BackupAndRestore) in the middle of an epoch: the epoch
            # restarts from its first batch, so skip what was already trained on.
            state.resume_skip.assign(state.epoch_step)
        state.epoch_step.assign(0)
        self._first_epoch = False

    def on_epoch_end(self, epoch, logs=None):
        accumulation = self._accumulation.value
        accumulation.end_of_data()
        self._state.epoch_step.assign(0)
        accumulation.write_logs(logs)
        accumulation.warn_if_inexact()
        accumulation.warn_if_skipped()

    def on_train_end(self, logs=None):
        self._accumulation.value.end_of_data()
        if self._calls == 0 and self.epochs_to_run:
            raise ValueError(_fit_common.EMPTY_FIT)


def _scaled(gradient, factor):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def check_model(model) -> None:
    """Checks a built model's variables where the doors receive it (one
    tf.distribute strategy for all of them)."""
    distribution_of(model.trainable_variables)


def optimizers_of(model) -> list:
    """The Keras optimizers a model holds: `model.optimizer` first, then any other
    optimizer attribute (a GAN's generator and discriminator optimizers)."""
    found = []
    candidates = [getattr(model, "optimizer", None)]
    for value in vars(model).values():
        if isinstance(value, dict):
            candidates += list(value.values())
        elif isinstance(value, (list, tuple)):
            candidates += list(value)
        else:
            candidates.append(value)
    for optimizer in candidates:
        if optimizer is not None and kc.is_optimizer(optimizer):
            if all(optimizer is not other for other in found):
                found.append(optimizer)
    return found


class Accumulation:
    """Gradient accumulation attached to a model that `fit` trains (the host).

    Args:
        options: the checked `Options`.
        layers: the model whose `gradaccum.BatchNormalization` layers the exact
            step drives (the host itself, or `wrap`'s inner model).
    """

    def __init__(self, options: Options, layers):
        self.options = options
        self._host = None
        self._layers = Untracked(layers)
        self.normalizers = NormalizerLog()
        self.state: FitState | None = None
        self.resumable = False
        self._end_of_data_function = None
        self._inexact_warned = False
        # A model's own step: the micro-batch being trained and a guard against
        # intercepting gradaccum's own optimizer calls.
        # Per thread: MirroredStrategy runs each replica's step in a thread of its
        # own (the micro-batch in training, what its step handed over).
        self._local = threading.local()
        # The optimizers' `apply` is redirected while any replica is in its step.
        self._redirect_lock = threading.Lock()
        self._redirected = []
        self._redirect_users = 0
        self._pending = {}
        self._own_step = None
        # A model's own step: the optimizers it handed gradients to, in order.
        self._handed = []
        # `accumulate`: the compile the user made, restored by `disable`.
        self.user_compile_config = None
        # Split mode: whether XLA compiles each micro-batch (the host's jit_compile),
        # and the search of micro_batch_size="auto".
        self._micro_batch_jit = False
        self.auto_size = (
            _split.AutoSize(options.max_micro_batch_size) if options.auto else None
        )
        self._verbose = 0
        self._announced = None

    @property
    def host(self):
        return self._host.value

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size of split mode: the one given, or the one
        `"auto"` chose (None before its first batch, and in `steps` mode)."""
        if self.auto_size is not None:
            return self.auto_size.chosen
        return self.options.micro_batch_size

    def size_chosen(self) -> None:
        """`"auto"` ran a batch: the host's `micro_batch_size` follows the search,
        which says once (when `fit` is verbose) where it settled."""
        search = self.auto_size
        self.host.__dict__["micro_batch_size"] = search.chosen
        # Said when a size that ran out of memory decided it (and again if the
        # search later settles elsewhere); without a failure nothing is split.
        if search.settled and search.fails is not None and self._announced != search.chosen:
            self._announced = search.chosen
            if self._verbose:
                failed = ", ".join(str(size) for size in search.failures)
                reason = f" ({failed} ran out of memory)" if failed else ""
                # On a line of its own, after the progress bar's.
                start = "\n" if self._verbose in (1, "auto") else ""
                print(
                    f'{start}gradaccum: micro_batch_size="auto" settled on '
                    f"{search.chosen} samples per micro-batch{reason}."
                )

    def make_train_function(self, make, force=False):
        """Makes the host's train function with Keras's `make` (its own
        `make_train_function`), after the state; in split mode with `jit_compile`
        each micro-batch is compiled with XLA rather than the whole step, and with
        `"auto"` the function retries a batch that ran out of memory."""
        self.ensure_state()
        host = self.host
        self._micro_batch_jit = bool(
            self.options.split and not host.run_eagerly and host.jit_compile
        )
        if self._micro_batch_jit:
            # Keras reads `jit_compile` when it makes the function.
            host.jit_compile = False
            try:
                make(force=force)
            finally:
                host.jit_compile = True
        else:
            make(force=force)
        function = host.train_function
        if self.options.split and not getattr(function, "gradaccum_wrapped", False):
            if self.options.auto:
                function = _retry.retrying(self, function)
            else:
                function = _retry.resetting_on_error(self, function)
        if self._skips_outside_the_step() and not getattr(function, "gradaccum_skips", False):
            function = self._skipping_restored(function)
        host.train_function = function
        return host.train_function

    def _skips_outside_the_step(self) -> bool:
        """Under several replicas the micro-batches a restored fit already trained
        on are skipped outside the compiled step: there the step's replicas meet
        (merge_call), which they cannot do inside a `tf.cond`."""
        return self.resumable and self.host.distribute_strategy.num_replicas_in_sync > 1

    def _skipping_restored(self, function):
        """`function`, except while micro-batches restored by BackupAndRestore are
        still to be skipped: then a call takes the next batch from the iterator and
        drops it (Keras's multi-step function fails under several replicas, so a call
        is one batch)."""
        state = self.state

        def train_function(iterator):
            if int(state.resume_skip.numpy()) <= 0:
                return function(iterator)
            next(iterator)
            state.resume_skip.assign(state.resume_skip - 1)
            state.epoch_step.assign(state.epoch_step + 1)
            return self.with_counters(self.host.get_metrics_result())

        train_function.gradaccum_skips = True
        train_function.gradaccum_wrapped = getattr(function, "gradaccum_wrapped", False)
        return train_function

    def replicas(self) -> int:
        """Replicas the host trains on (its strategy's)."""
        return self.host.distribute_strategy.num_replicas_in_sync

    def evaluating(self):
        """The context `evaluate` runs in (each worker's own evaluation under
        MultiWorkerMirroredStrategy)."""
        return kc.across_workers(self.host)

    def open_micro_batches(self) -> int:
        """Micro-batches in the open windows (0 without a state)."""
        if self.state is None:
            return 0
        return sum(int(acc.window_length().numpy()) for acc in self.state.accumulators())

    def detach(self) -> None:
        """`disable`: nothing of the state lives in the host on TensorFlow."""

    def after_train_on_batch(self, logs):
        """`train_on_batch`'s logs as they are: on TensorFlow the step raises itself."""
        return logs

    def attach(self, host, own_step=None) -> None:
        """Attaches to `host`; `own_step` is the host's own `train_step` (bound), or
        None for gradaccum's exact step."""
        self._host = Untracked(host)
        self._own_step = own_step

    def forget(self) -> None:
        """Drops the state (a new compile): it is created again before training,
        with the open window's values, which nothing may lose silently."""
        if self.state is not None:
            # The windows, not the epoch position: a new fit starts an epoch.
            saved = {
                k: v.numpy()
                for k, v in self.saved_variables().items()
                if k not in ("epoch_step", "resume_skip")
            }
            self._pending = {**saved, **self._pending}
        self.state = None
        self._handed = []
        self._end_of_data_function = None

    # fit -----------------------------------------------------------------------

    def fit(self, fit, x, y, batch_size, epochs, verbose, callbacks, kwargs):
        """Runs `fit` (the host's own) with gradaccum's hook first among callbacks."""
        host = self.host
        self._verbose = verbose
        hook = EpochHook(self)
        hook.epochs_to_run = epochs > kwargs.get("initial_epoch", 0)
        callbacks, resumable = _fit_common.hook_first(hook, callbacks)
        if resumable != self.resumable:
            # The step that can skip restored micro-batches costs a branch per
            # micro-batch: compile it only for fits that can restore.
            self.resumable = resumable
            host.train_function = None
        if self.state is not None:
            # A new fit starts at an epoch's beginning; BackupAndRestore may then
            # restore a position inside an epoch.
            self.state.epoch_step.assign(0)
            self.state.resume_skip.assign(0)
        with kc.across_workers(host), kc.observing_epoch_length(host, hook):
            return fit(
                x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                callbacks=callbacks, **kwargs,
            )

    def before_evaluate(self, kwargs) -> None:
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit sees the epoch's partial window applied.
            self.end_of_data()

    def write_logs(self, logs) -> None:
        """`updates` (the optimizer's update count), `window_micro_batches` and
        `window_weight` (what the last update's window held) and `skipped` in fit's
        logs."""
        if logs is None or self.state is None:
            return
        optimizer = self._updating_optimizer()
        if optimizer is not None:
            logs["updates"] = float(optimizer.iterations.numpy())
        logs.update(
            {key: float(value.numpy()) for key, value in self._last_window().items()}
        )
        if self.skips_possible():
            logs["skipped"] = float(self.state.skipped)
        if self.auto_size is not None and self.auto_size.chosen is not None:
            logs["micro_batch_size"] = float(self.auto_size.chosen)

    def with_counters(self, logs):
        """The step's logs with `updates` and `skipped`, read in the compiled step
        (no host round trip per batch); the epoch's are written by the hook after
        its end-of-data window."""
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        optimizer = self._updating_optimizer()
        if optimizer is not None:
            logs["updates"] = tf.cast(optimizer.iterations, tf.float32)
        logs.update(
            {key: tf.cast(value, tf.float32) for key, value in self._last_window().items()}
        )
        if self.skips_possible():
            counts = [tf.cast(acc.skipped, tf.float32) for acc in self.state.accumulators()]
            logs["skipped"] = tf.add_n(counts) if counts else tf.constant(0.0)
        return logs

    def _last_window(self) -> dict:
        """What the last update's window held (`window_micro_batches`,
        `window_weight`), of the accumulator that applies with the updating
        optimizer; empty before there is one."""
        optimizer = self._updating_optimizer()
        accumulators = list(self.state.own)
        if self.state.accumulator is not None:
            accumulators.insert(0, (self.state.accumulator, self.host.optimizer))
        for acc, owner in accumulators:
            if owner is optimizer:
                return {
                    "window_micro_batches": acc.last_window_micro_batches,
                    "window_weight": acc.last_window_weight,
                }
        return {}

    def _updating_optimizer(self):
        """The optimizer whose update count `updates` logs: the model's `optimizer`,
        unless the model's own train_step never handed it gradients while it trained
        other optimizers (a GAN's, created in its `compile`: `model.optimizer` is then
        Keras's unused default). Known once the step is traced."""
        optimizer = getattr(self.host, "optimizer", None)
        # The optimizers the step handed gradients to (under several replicas
        # `model.optimizer` has an accumulator made before tracing, used or not).
        used = list(self._handed) or [owner for _, owner in self.state.own]
        if not used or any(owner is optimizer for owner in used):
            return optimizer
        return used[0]

    def skips_possible(self) -> bool:
        optimizer = getattr(self.host, "optimizer", None)
        return self.options.nonfinite != "apply" or (
            optimizer is not None and kc.is_loss_scale_optimizer(optimizer)
        )

    # State -----------------------------------------------------------------------

    def ensure_state(self) -> None:
        """Creates the accumulation state before the train function is traced."""
        if self.state is not None:
            return
        host = self.host
        layers = self._layers.value
        if self.options.split:
            check_split_synchronization(
                host.distribute_strategy, kc.flatten_layers(layers),
                self.options.micro_batch_size,
            )
        if self._own_step is not None and not host.built:
            # A subclassed model with its own step is built by its first step:
            # its accumulators are made when the step hands gradients over.
            self.state = FitState(None)
            self._restore_pending()
            return
        if not layers.built:
            raise ValueError(
                "The model being trained must be built before its accumulation state is "
                f"created. Received: model {layers.name!r} that is not built "
                "(fit builds it from its first batch: is the data empty?). Give the "
                "model an Input, or call it on a batch first."
            )
        if not host.trainable_variables:
            raise ValueError(
                "The model being trained must have trainable variables to accumulate "
                f"gradients of. Received: model {layers.name!r} with none."
            )
        terms = max(0, kc.count_compiled_losses(kc.compiled_loss(host)) - 1)
        with host.distribute_strategy.scope():
            distribution_of(host.trainable_variables)
            if host.optimizer is not None and not host.optimizer.built:
                # Before tracing: a loss scale read in the step must be a variable.
                host.optimizer.build(host.trainable_variables)
            accumulator = None
            if self._own_step is None:
                accumulator = self.options.accumulator(host.trainable_variables,
                                                       layers=layers)
            self.state = FitState(accumulator, terms=terms)
            replicas = host.distribute_strategy.num_replicas_in_sync
            if accumulator is None and host.optimizer is not None and replicas > 1:
                # A model's own step usually hands all its trainable variables to
                # `self.optimizer`. Under several replicas that accumulator is made
                # before tracing (a replica cannot create the strategy's variables);
                # on one device every accumulator is made when the step first hands
                # gradients to its optimizer, so an optimizer the step never uses
                # (Keras's default, beside a GAN's own two) costs no memory.
                self._own_accumulator(host.optimizer, list(host.trainable_variables))
        # The layers record only inside this model's training step (see
        # `exact_step`): elsewhere they stay Keras's layer.
        for acc in self.state.accumulators():
            for layer in acc.batch_normalization_layers:
                layer._accumulated = False
        self._restore_pending()

    def saved_variables(self) -> dict:
        return {} if self.state is None else self.state.saved_variables()

    def save_to(self, store) -> None:
        for key, variable in self.saved_variables().items():
            store[f"gradaccum_{key}"] = variable.numpy()

    def load_from(self, store) -> None:
        """Restores what `save_to` wrote; values of accumulators not created yet
        wait until they are."""
        self._pending = {
            key[len("gradaccum_"):]: np.asarray(store[key])
            for key in store.keys()
            if key.startswith("gradaccum_")
        }
        if self._pending and getattr(self.host, "optimizer", None) is not None:
            self.ensure_state()
            self._restore_pending()
        # Before compile the values wait: the state is made before training.

    def _restore_pending(self) -> None:
        if not self._pending or self.state is None:
            return
        _fit_common.restore(self.saved_variables(), self._pending)

    # The training step -----------------------------------------------------------

    def train_step(self, data):
        """One micro-batch: gradaccum's exact step, or the model's own step with its
        optimizer calls accumulated."""
        own_step = self._own_step
        if self.options.split:
            step = self.split_step
        elif own_step is None:
            step = self.exact_step
        else:
            step = lambda data: self.intercepted_step(own_step, data)  # noqa: E731
        if not self.resumable or self._skips_outside_the_step():
            return self.with_counters(step(data))
        # Under BackupAndRestore a fit may restart inside an epoch and must skip the
        # micro-batches already trained on. The training branch is traced first:
        # the skipping branch reports logs of the same structure.
        spec = []

        def train():
            logs = self.with_counters(step(data))
            spec.append(tf.nest.map_structure(tf.convert_to_tensor, logs))
            return logs

        def skip():
            state = self.state
            state.resume_skip.assign_sub(1)
            state.epoch_step.assign_add(1)
            if own_step is None:
                return self.with_counters(self.host.get_metrics_result())
            return tf.nest.map_structure(lambda t: tf.zeros_like(t), spec[0])

        return tf.cond(self.state.resume_skip <= 0, train, skip)

    def exact_step(self, data):
        """gradaccum's step for a host that uses Keras's default `train_step`: one
        micro-batch, and an update when the window is due."""
        host = self.host
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        acc = self.state.accumulator
        # A window of one micro-batch on one device: G = w g / w = g, applied
        # without the accumulators' copy.
        single = self.options.window.constant == 1 and not (
            tf.distribute.has_strategy()
            or kc.is_loss_scale_optimizer(host.optimizer)
            or acc.batch_normalization_layers
        )
        y_pred, loss, weight = self._exact_micro_batch(x, y, sample_weight, single=single)
        kc.loss_tracker(host).update_state(loss, sample_weight=weight)
        self.state.epoch_step.assign_add(1)
        if not single:
            self._close_if_due(acc, host.optimizer)
        return host.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _exact_micro_batch(self, x, y, sample_weight, single=False):
        """Forward, the host's loss and backward of one micro-batch, accumulated
        (applied at once when `single`). Returns the predictions, the loss (as the
        loss tracker takes it) and the micro-batch's weight."""
        host = self.host
        acc = self.state.accumulator
        variables = list(acc.target_variables)
        self.normalizers.take()
        loss_scaled = kc.is_loss_scale_optimizer(host.optimizer)
        # With reduction "mean", differentiate w_i * L_i: the weight is applied once
        # to the loss rather than to every gradient. Under tf.distribute, L_i is the
        # replica's own loss (Keras divides it by the replica count: undone here),
        # so that the reduced sums give the global window's gradient exactly; with
        # reduction "sum" the replicas' gradients are summed, as Keras's optimizer
        # does. Under loss scaling the weight is applied with the unscaling instead,
        # so that the scaled loss is what Keras would scale (no extra overflows).
        mean = self.options.reduction == "mean"
        weigh_loss = mean and not (single or loss_scaled)
        with tf.GradientTape() as tape, batch_norm.driving(acc.batch_normalization_layers):
            if kc.call_has_training_arg(host):
                y_pred = host(x, training=True)
            else:
                y_pred = host(x)
            loss = kc.compute_loss(host, x, y, y_pred, sample_weight)
            weight = tf.stop_gradient(self.micro_batch_weight(x, y, sample_weight, True))
            # The replica's own loss (Keras's divided by the replica count).
            replica_loss = kc.unscale_loss_for_distribution(loss)
            objective = replica_loss if mean else loss
            if weigh_loss:
                objective = objective * tf.cast(weight, loss.dtype)
            # Loss scaling (a LossScaleOptimizer's dynamic scale, or an optimizer's
            # static `loss_scale_factor`), as Keras's own train step does.
            objective = host.optimizer.scale_loss(objective)
        gradients = tape.gradient(objective, variables)
        if single:
            acc._apply_single(host.optimizer, gradients, weight)
        elif loss_scaled:
            # Unscaled and weighed in one multiply by the accumulator.
            acc.accumulate(gradients, weight, loss_scale_optimizer=host.optimizer)
        else:
            acc.accumulate_weighted(gradients, weight)
        return y_pred, replica_loss, weight

    # Split mode ------------------------------------------------------------------

    def split_step(self, data):
        """One batch split into micro-batches (`micro_batch_size`), their gradients
        combined exactly and applied once: the batch is the window."""
        state = self.state
        own_step = self._own_step
        state.epoch_step.assign_add(1)
        size = self._micro_batch_size_in_step()
        if own_step is None:
            host = self.host
            micro_batch = self._exact_split_micro_batch
            if self._micro_batch_jit:
                # XLA compiles each micro-batch; the loop around it stays outside,
                # so a smaller last micro-batch is one more compiled shape.
                micro_batch = tf.function(micro_batch, jit_compile=True, autograph=False)
            zero = tf.constant(0.0)
            weighted, weights = _split.for_each(data, size, micro_batch, (zero, zero))
            after = [weighted, weights]
            # The batch's loss, logged as Keras logs a batch's: weighted by its size.
            kc.loss_tracker(host).update_state(
                tf.math.divide_no_nan(weighted, weights),
                sample_weight=_split.batch_size(data),
            )
            logs = host.get_metrics_result()
            pairs = [(state.accumulator, host.optimizer)]
        else:
            logs = _split.fold(
                data, size, lambda micro: self.intercepted_step(own_step, micro)
            )
            after = tf.nest.flatten(logs)
            pairs = list(state.own)
        if self.options.auto:
            # Ops on different variables are not ordered by themselves: the flag
            # follows the micro-batches, and the update follows the flag.
            with tf.control_dependencies(after):
                after = [tf.convert_to_tensor(state.applying.assign(True))]
        with tf.control_dependencies(after):
            for acc, optimizer in pairs:
                acc.apply(optimizer)
        return logs

    def _exact_split_micro_batch(self, micro, weighted, weights):
        """One micro-batch of a split batch; adds its weighted loss and weight to
        the batch's."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro)
        y_pred, loss, weight = self._exact_micro_batch(x, y, sample_weight)
        self.host.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        weight = tf.cast(weight, tf.float32)
        return weighted + tf.cast(loss, tf.float32) * weight, weights + weight

    def _micro_batch_size_in_step(self):
        if self.options.auto:
            return tf.cast(self.state.micro_batch_size, tf.int32)
        return tf.constant(self.options.micro_batch_size, tf.int32)

    def intercepted_step(self, own_step, data):
        """The model's own `train_step`, its optimizer calls accumulated."""
        host = self.host
        if not self.options.split:
            self.state.epoch_step.assign_add(1)
        local = self._local
        local.micro_batch = keras.utils.unpack_x_y_sample_weight(data)
        self.normalizers.take()
        local.intercepted = 0
        local.calls_in_step = {}
        layers = []
        if self.state.own:
            layers = self.state.own[0][0].batch_normalization_layers
        self._redirect(optimizers_of(host))
        try:
            with batch_norm.driving(layers):
                logs = own_step(data)
        finally:
            self._end_redirect()
        local.micro_batch = None
        if not local.intercepted:
            raise ValueError(
                f"The train_step of {type(host).__name__} must hand its gradients to an "
                "optimizer of the model (`self.optimizer.apply_gradients(...)` or "
                "`.apply(...)`) for gradaccum to accumulate them. Received: a step "
                "that called neither on any optimizer attribute of the model, so "
                "nothing would be trained."
            )
        return logs

    def _redirect(self, optimizers) -> None:
        """Routes each optimizer's `apply` (which `apply_gradients` calls) to the
        accumulators, while any replica is inside its step."""
        with self._redirect_lock:
            self._redirect_users += 1
            if self._redirect_users > 1:
                return
            for optimizer in optimizers:
                self._redirected.append(
                    (optimizer, "apply" in optimizer.__dict__, optimizer.__dict__.get("apply"))
                )

                def apply(grads, trainable_variables=None, *, _opt=optimizer):
                    # gradaccum's own updates go past this (kc.apply_gradients).
                    return self._accumulate_own(_opt, grads, trainable_variables)

                optimizer.apply = apply

    def _end_redirect(self) -> None:
        with self._redirect_lock:
            self._redirect_users -= 1
            if self._redirect_users:
                return
            for optimizer, had, value in self._redirected:
                if had:
                    optimizer.apply = value
                else:
                    del optimizer.apply
            self._redirected = []

    def _accumulate_own(self, optimizer, grads, trainable_variables):
        local = self._local
        local.intercepted += 1
        if all(optimizer is not other for other in self._handed):
            self._handed.append(optimizer)
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = kc.optimizer_variables_of(optimizer)
        variables = list(trainable_variables)
        # A step that hands the same variables to the same optimizer twice makes
        # two updates per batch: one accumulator per call, each once per window.
        key = (id(optimizer), tuple(id(v) for v in variables))
        occurrence = local.calls_in_step.get(key, 0)
        local.calls_in_step[key] = occurrence + 1
        acc = self._own_accumulator(optimizer, variables, occurrence)
        x, y, sample_weight = local.micro_batch
        weight = self.micro_batch_weight(x, y, sample_weight, False)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1 and self.options.reduction == "mean":
            # Keras's losses divide a replica's loss by the replica count (its
            # optimizer then sums the replicas): undone, so that the weighted
            # window is the global window's gradient. Reduction "sum" sums the
            # replicas' gradients as Keras's optimizer does: kept.
            grads = [_scaled(g, replicas) for g in grads]
        if kc.is_loss_scale_optimizer(optimizer):
            acc.accumulate(grads, weight, loss_scale_optimizer=optimizer)
        else:
            acc.accumulate(grads, weight)
        if not self.options.split:
            # In split mode the batch's step applies once its micro-batches are in.
            self._close_if_due(acc, optimizer)
        return optimizer.iterations

    def _own_accumulator(self, optimizer, variables, occurrence=0):
        found = self._find_own(optimizer, variables, occurrence)
        if found is not None:
            return found
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            # A replica cannot create the strategy's variables (a GAN's second
            # optimizer, met in the traced step): the replicas, which trace the same
            # step, meet here and one cross-replica call makes the accumulator.
            tf.distribute.get_replica_context().merge_call(
                lambda _: self._find_own(optimizer, variables, occurrence)
                or self._new_own(optimizer, variables)
            )
            return self._find_own(optimizer, variables, occurrence)
        return self._new_own(optimizer, variables)

    def _find_own(self, optimizer, variables, occurrence):
        for acc, owner in self.state.own:
            if owner is optimizer and len(acc.target_variables) == len(variables) and all(
                a is b for a, b in zip(acc.target_variables, variables)
            ):
                if occurrence == 0:
                    return acc
                occurrence -= 1
        return None

    def _new_own(self, optimizer, variables):
        layers = self._layers.value if not self.state.own else None
        name = f"gradaccum_own_{len(self.state.own)}"
        # Made (and given any restored values) outside the step being traced, once.
        with tf.init_scope():
            acc = self.options.accumulator(variables, layers=layers, name=name)
            for layer in acc.batch_normalization_layers:
                layer._accumulated = False
            self.state.own.append((acc, optimizer))
            self._restore_pending()
        return acc

    def micro_batch_weight(self, x, y, sample_weight, exact_step: bool):
        """`w_i`: 1 (uniform), the user's callable, the compiled loss's normalizer
        when the step computed it (exact), else the micro-batch's size."""
        weighting = self.options.weighting
        if weighting == "uniform":
            return tf.constant(1.0)
        if callable(weighting):
            weight = callable_weight(weighting, x, y, sample_weight)
            check = tf.debugging.assert_greater_equal(weight, 0.0, message=NEGATIVE_WEIGHT)
            with tf.control_dependencies([check] if check is not None else []):
                return tf.identity(weight)
        normalizers = self.normalizers.take()
        if not normalizers:
            if exact_step:
                self._warn_no_compiled_loss()
            first = next(t for t in tf.nest.flatten(x) if t is not None)
            return tf.cast(tf.shape(first)[0], tf.float32)
        if len(normalizers) > 1 and exact_step:
            self._track_term_ratios(normalizers)
        return normalizers[0]

    def _track_term_ratios(self, normalizers):
        state = self.state
        ratios = tf.stack([tf.math.divide_no_nan(n, normalizers[0]) for n in normalizers[1:]])
        first_in_window = state.accumulator.micro_step == 0
        differs = tf.reduce_any(
            tf.abs(ratios - state.term_ratios) > 1e-6 * tf.abs(state.term_ratios)
        )
        state.inexact.assign(
            tf.logical_or(state.inexact, tf.logical_and(~first_in_window, differs))
        )
        state.term_ratios.assign(tf.where(first_in_window, ratios, state.term_ratios))

    def _end_of_data_in_step(self):
        state = self.state
        return tf.logical_and(state.epoch_length > 0, state.epoch_step >= state.epoch_length)

    def _close_if_due(self, acc, optimizer) -> None:
        _window.close_if_due(acc, optimizer, self.options.partial, self._end_of_data_in_step())

    def end_of_data(self) -> None:
        """Closes the open windows as `partial` says (idempotent)."""
        if self.state is None or self.options.partial == "carry":
            return
        host = self.host
        if self._end_of_data_function is None:
            pairs = [(self.state.accumulator, host.optimizer)] if self.state.accumulator else []
            pairs += [(acc, optimizer) for acc, optimizer in self.state.own]

            def close():
                for acc, optimizer in pairs:
                    _window.close_at_end(acc, optimizer, self.options.partial)
                return tf.constant(True)

            self._end_of_data_function = close if host.run_eagerly else tf.function(close)
        with host.distribute_strategy.scope():
            self._end_of_data_function()

    # Warnings --------------------------------------------------------------------

    def warn_if_inexact(self) -> None:
        state = self.state
        if state is None or self._inexact_warned or not bool(state.inexact.numpy()):
            return
        self._inexact_warned = True
        _fit_common.warn_inexact()

    def warn_if_skipped(self) -> None:
        state = self.state
        if state is None or self.options.nonfinite != "skip":
            return
        if kc.is_loss_scale_optimizer(self.host.optimizer):
            return  # loss scaling skips overflowing micro-batches by design
        skipped = state.skipped
        if skipped:
            state.accumulators()[0]._warn_skipped(skipped, stacklevel=3)

    def _warn_no_compiled_loss(self):
        _fit_common.warn_no_compiled_loss()
