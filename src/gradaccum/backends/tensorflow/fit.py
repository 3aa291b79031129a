"""Accumulation inside Keras's `fit()` on TensorFlow: one mechanism for both doors.

`Accumulation` attaches to the model being trained (the *host*): the user's own
model (`gradaccum.accumulate`) or `wrap`'s `AccumulatingModel`. It holds the
options and the accumulation state (`state.FitState`) and runs one of three steps:

- a host that uses Keras's default `train_step` trains with gradaccum's exact step
  (`exact_step.py`);
- a host whose class defines its own `train_step` runs it unchanged, its optimizer
  calls accumulated (`own_step.py`);
- split mode cuts each batch into micro-batches inside the step (`split_step.py`).

Epoch positions, the end of the data (the window policy of `window.py`), resuming
under `BackupAndRestore` (`resume.py`) and the log entries (`logs.py`) are kept by a
callback that runs first among `fit`'s callbacks (`hook.py`).
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from gradaccum import _fit_common
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import logs as _logs
from gradaccum.backends.tensorflow import resume
from gradaccum.backends.tensorflow import retry as _retry
from gradaccum.backends.tensorflow import window as _window
from gradaccum.backends.tensorflow.accumulator import GradientAccumulator
from gradaccum.backends.tensorflow.distributed import (
    check_split_synchronization,
    distribution_of,
)
from gradaccum.backends.tensorflow.exact_step import exact_step
from gradaccum.backends.tensorflow.hook import EpochHook
from gradaccum.backends.tensorflow.own_step import OwnStep
from gradaccum.backends.tensorflow.split_step import split_step
from gradaccum.backends.tensorflow.state import FitState, Untracked
from gradaccum.core.auto_size import AutoSize
from gradaccum.core.options import Options as CoreOptions
from gradaccum.core.privacy import check_fit as check_private_fit
from gradaccum.core.privacy import check_layers as check_private_layers
from gradaccum.weighting import NormalizerLog

PARTIALS = _window.PARTIALS


class Options(CoreOptions):
    """The checked options (`gradaccum.core.options.Options`) with TensorFlow's
    window rule (a schedule's callable runs as a `tf.function`) and accumulators."""

    window_rule = _window.WindowRule

    def accumulator(self, variables, *, layers=None, name="gradient_accumulator"):
        accumulator = GradientAccumulator(
            variables,
            steps=self.window,
            reduction=self.reduction,
            accumulator_dtype=self.accumulator_dtype,
            layers=layers,
            nonfinite=self.nonfinite,
            name=name,
        )
        # A new accumulator's window is empty: so are the windows of the layers it
        # drives. Whatever their state variables held (values left by an earlier
        # accumulation, or written by `set_weights`, whose list includes them) would
        # otherwise be pooled into the first window. A saved window is restored
        # afterwards (`Accumulation.restore_pending`), with the accumulator's.
        for layer in accumulator.batch_normalization_layers:
            layer._reset_window()
        if self.privacy is not None:
            accumulator._privacy = Untracked(self.privacy)
            # A variable made in the strategy's scope: under several workers its
            # initial value is the chief's, so every worker draws the same noise.
            accumulator._noise_seed = tf.Variable(
                self.privacy.noise_seed(), dtype=tf.int64, trainable=False,
                name="noise_seed",
            )
        return accumulator


def check_model(model) -> None:
    """Checks a built model's variables where the doors receive it (one
    tf.distribute strategy for all of them)."""
    distribution_of(model.trainable_variables)



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
        self._repeat_warned = False
        self._pending = {}
        # The host's own `train_step` (bound; None: gradaccum's exact step), and
        # what runs it with its optimizer calls accumulated.
        self.own_train_step = None
        self.own_step = OwnStep(self)
        # `accumulate`: the compile the user made, restored by `disable`.
        self.user_compile_config = None
        # Split mode: whether XLA compiles each micro-batch (the host's jit_compile),
        # and the search of micro_batch_size="auto".
        self.micro_batch_jit = False
        self.auto_size = (
            AutoSize(options.max_micro_batch_size) if options.auto else None
        )
        self._verbose = 0
        self._announced = None

    @property
    def host(self):
        """The model `fit` trains."""
        return self._host.value

    @property
    def layers(self):
        """The model whose `gradaccum.BatchNormalization` layers the step drives."""
        return self._layers.value

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size of split mode: the one given, or the one
        `"auto"` chose (None before its first batch, and in `steps` mode)."""
        if self.auto_size is not None:
            return self.auto_size.chosen
        return self.options.micro_batch_size

    def size_chosen(self) -> None:
        """`"auto"` ran a batch (see `_fit_common.size_chosen`)."""
        _fit_common.size_chosen(self)

    def make_train_function(self, make, force=False):
        """Makes the host's train function with Keras's `make` (its own
        `make_train_function`), after the state; in split mode with `jit_compile`
        each micro-batch is compiled with XLA rather than the whole step, and with
        `"auto"` the function retries a batch that ran out of memory."""
        self.ensure_state()
        host = self.host
        self.micro_batch_jit = bool(
            self.options.split and not host.run_eagerly and host.jit_compile
        )
        if self.micro_batch_jit:
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
        if resume.skips_outside_the_step(self) and not getattr(
            function, "gradaccum_skips", False
        ):
            function = resume.skipping_restored(self, function)
        host.train_function = _logs.unpacking(function)
        return host.train_function

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
        self.own_train_step = own_step

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
            # Each window's sums by the variable they belong to.
            for prefix, acc in self._prefixed():
                saved = _fit_common.keyed_by_variable(
                    saved, acc.target_variables, prefix, vectors=("received",)
                )
            self._pending = {**saved, **self._pending}
        self.state = None
        self.own_step.handed = []
        self._end_of_data_function = None

    # fit -----------------------------------------------------------------------

    def fit(self, fit, x, y, batch_size, epochs, verbose, callbacks, kwargs):
        """Runs `fit` (the host's own) with gradaccum's hook first among callbacks."""
        host = self.host
        check_private_fit(self.options, x, batch_size)
        self._verbose = verbose
        hook = EpochHook(self)
        self._repeat_warned = False
        callbacks = _fit_common.begin_fit(self, hook, epochs, callbacks, kwargs)
        try:
            with kc.across_workers(host), kc.observing_epoch_length(host, hook):
                history = fit(
                    x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                    callbacks=callbacks, **kwargs,
                )
        except BaseException:
            _fit_common.after_fit(self, failed=True)
            raise
        _fit_common.after_fit(self)
        return history

    def before_evaluate(self, kwargs) -> None:
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit sees the epoch's partial window applied.
            self.end_of_data()

    # State -----------------------------------------------------------------------

    def ensure_state(self) -> None:
        """Creates the accumulation state before the train function is traced."""
        if self.state is not None:
            return
        host = self.host
        layers = self.layers
        if self.options.split:
            check_split_synchronization(
                host.distribute_strategy, kc.flatten_layers(layers),
                self.options.micro_batch_size,
            )
        if self.own_train_step is not None and not host.built:
            # A subclassed model with its own step is built by its first step:
            # its accumulators are made when the step hands gradients over.
            self.state = FitState(None)
            self.restore_pending()
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
        if self.options.privacy is not None:
            check_private_layers(layers)
            if kc.is_loss_scale_optimizer(host.optimizer):
                raise ValueError(
                    "`privacy` needs an optimizer without loss scaling: each example's "
                    "gradient is clipped before the sum. Received: a LossScaleOptimizer "
                    "(the mixed_float16 policy); use mixed_bfloat16 or float32."
                )
        terms = max(0, kc.count_compiled_losses(kc.compiled_loss(host)) - 1)
        with host.distribute_strategy.scope():
            distribution_of(host.trainable_variables)
            if host.optimizer is not None and not host.optimizer.built:
                # Before tracing: a loss scale read in the step must be a variable.
                host.optimizer.build(host.trainable_variables)
            accumulator = None
            if self.own_train_step is None:
                accumulator = self.options.accumulator(host.trainable_variables,
                                                       layers=layers)
            self.state = FitState(accumulator, terms=terms,
                                  private=self.options.privacy is not None)
            replicas = host.distribute_strategy.num_replicas_in_sync
            if accumulator is None and host.optimizer is not None and replicas > 1:
                # A model's own step usually hands all its trainable variables to
                # `self.optimizer`. Under several replicas that accumulator is made
                # before tracing (a replica cannot create the strategy's variables);
                # on one device every accumulator is made when the step first hands
                # gradients to its optimizer, so an optimizer the step never uses
                # (Keras's default, beside a GAN's own two) costs no memory.
                self.own_step.accumulator(host.optimizer, list(host.trainable_variables))
        # The layers record only inside this model's training step (see
        # `exact_step`): elsewhere they stay Keras's layer.
        for acc in self.state.accumulators():
            for layer in acc.batch_normalization_layers:
                layer._accumulated = False
        self.restore_pending()

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
            self.restore_pending()
        # Before compile the values wait: the state is made before training.

    def restore_pending(self) -> None:
        """Gives the state the values `load_from` (or a compile) left waiting."""
        if not self._pending or self.state is None:
            return
        for prefix, acc in self._prefixed():
            _fit_common.to_slots(
                self._pending, acc.target_variables, prefix, vectors=("received",)
            )
        _fit_common.restore(self.saved_variables(), self._pending)

    def _prefixed(self) -> list:
        """Each accumulator with the prefix of its names in `saved_variables`."""
        state = self.state
        pairs = [] if state.accumulator is None else [("", state.accumulator)]
        return pairs + [(f"own_{j}_", acc) for j, (acc, _) in enumerate(state.own)]

    # The training step -----------------------------------------------------------

    def train_step(self, data):
        """One micro-batch (a batch in split mode): gradaccum's exact step, or the
        model's own step with its optimizer calls accumulated; with the log entries."""
        own_step = self.own_train_step
        if self.options.split:
            step = lambda data: split_step(self, data)  # noqa: E731
        elif own_step is None:
            step = lambda data: exact_step(self, data)  # noqa: E731
        else:
            step = lambda data: self.own_step.run(own_step, data)  # noqa: E731
        if not self.resumable or resume.skips_outside_the_step(self):
            return _logs.with_counters(self, step(data))
        # Under BackupAndRestore a fit may restart inside an epoch and must skip the
        # micro-batches already trained on.
        return resume.skipping_step(self, step, data)

    def _end_of_data_in_step(self):
        state = self.state
        return tf.logical_and(state.epoch_length > 0, state.epoch_step >= state.epoch_length)

    def close_if_due(self, acc, optimizer) -> None:
        """Inside the step: closes `acc`'s window when it is due, or at the end of
        the data as `partial` says."""
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
            self.state.note_window()

    def privacy_record(self) -> tuple[int, float]:
        """With privacy: the updates made and the most examples a window held."""
        state = self.state
        if state is None or state.accumulator is None:
            # After a compile the values wait for the next state.
            pending = self._pending
            return (int(np.asarray(pending.get("updates", 0))),
                    float(np.asarray(pending.get("largest_window", 0.0))))
        return int(state.accumulator.updates.numpy()), float(state.largest_window.numpy())

    # Warnings --------------------------------------------------------------------

    def warn_if_inexact(self) -> None:
        state = self.state
        if state is None or self._inexact_warned or not bool(state.inexact.numpy()):
            return
        self._inexact_warned = True
        _fit_common.warn_inexact()

    # The audit ----------------------------------------------------------------------

    def window_gradients(self) -> list:
        """The open window's combined gradient: `(variable, value or None)` per
        variable of every accumulator (`gradaccum.audit`)."""
        if self.state is None:
            return []
        pairs = []
        for acc in self.state.accumulators():
            pairs += list(zip(acc.target_variables, acc.gradients()))
        return pairs

    def audit_findings(self) -> dict:
        """What the accumulation saw that makes it differ from the large batch."""
        state = self.state
        host = self.host
        return {
            "repeated": list(self.own_step.repeated),
            # Optimizer calls whose gradients depend on an earlier call's update.
            "stale": [(kc.optimizer_name(host, a), kc.optimizer_name(host, b))
                      for a, b in self.own_step.stale],
            "inexact": bool(state is not None and state.inexact.numpy()),
            "skipped": 0 if state is None else int(state.skipped),
        }

    def warn_if_repeated(self) -> None:
        """Once per fit: the model's step applies an optimizer several times per
        batch (`OwnStep.repeat_warning`)."""
        message = self.own_step.repeat_warning()
        if message is None or self._repeat_warned:
            return
        self._repeat_warned = True
        warnings.warn(message, stacklevel=3)

    def warn_if_skipped(self) -> None:
        state = self.state
        if state is None or self.options.nonfinite != "skip":
            return
        if kc.is_loss_scale_optimizer(self.host.optimizer):
            return  # loss scaling skips overflowing micro-batches by design
        skipped = state.skipped
        if skipped:
            state.accumulators()[0]._warn_skipped(skipped, stacklevel=3)

