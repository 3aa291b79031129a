"""Accumulation inside Keras's `fit()` on JAX: the adapter `gradaccum.accumulate`
attaches to the user's model.

`Accumulation` owns the state (`AccumulationState`, a metric the model tracks, so
the JAX trainer carries it through its jitted step), the step (`TrainStep`) and a
callback that runs first among `fit`'s: the epoch's position and length, the window
the data ends in, the errors the jitted step can only record, and the `updates` /
`skipped` entries of the epoch's logs.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

from gradaccum import _fit_common
from gradaccum import _keras_common as kc
from gradaccum.backends.jax import retry
from gradaccum.backends.jax.state import AccumulationState, layouts_of
from gradaccum.backends.jax.step import ERROR_KEY, TrainStep
from gradaccum.core.auto_size import AutoSize
from gradaccum.core.options import Options as CoreOptions
from gradaccum.core.privacy import check_fit as check_private_fit
from gradaccum.core.privacy import check_layers as check_private_layers
from gradaccum.core.privacy import spent
from gradaccum.core.screening import raise_message, warn_skipped
from gradaccum.core.window import SCHEDULE_RULE
from gradaccum.weighting import NEGATIVE_WEIGHT, NormalizerLog


class Options(CoreOptions):
    """The checked options; on JAX a schedule's callable is traced as it is, and
    tried on update 0 here (a wrong type or a first window below 1 is refused
    before a step is traced)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.accumulator_dtype == "float64":
            import jax

            if not jax.config.jax_enable_x64:
                raise ValueError(
                    "`accumulator_dtype` must be a dtype JAX computes in: float64 needs "
                    "jax.config.update('jax_enable_x64', True) before the model is made "
                    "(without it JAX keeps float32). Received: accumulator_dtype='float64'"
                )
        if callable(self.window.steps):
            # Traced first (the step traces it), then tried on update 0.
            self._check_traceable()
            first = int(self.window.length(0))
            if first < 1:
                raise ValueError(f"{SCHEDULE_RULE} Received: {first} for update_index=0")

    def _check_traceable(self) -> None:
        import jax

        try:
            jax.eval_shape(self.window.length, jax.ShapeDtypeStruct((), "int32"))
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError) as error:
            raise ValueError(
                "The `steps` callable must be traceable by JAX: written with "
                "`keras.ops` / `jax.numpy` (`jnp.where` rather than a Python `if` "
                "on the update index). Received: a callable that failed on a "
                f"traced update index: {type(error).__name__}"
            ) from None


def check_model(model) -> None:
    """Nothing to check on JAX where the doors receive a built model."""


class Accumulation:
    """Gradient accumulation attached to a model that `fit` trains on JAX.

    Args:
        options: the checked `Options`.
        layers: the model trained (the host itself, or `wrap`'s inner model).
    """

    def __init__(self, options: Options, layers):
        self.options = options
        self.host = None
        self.normalizers = NormalizerLog()
        self.state: AccumulationState | None = None
        self.step: TrainStep | None = None
        self.own_train_step = None
        self.resumable = False
        self.user_compile_config = None
        self._pending = {}
        self._warned = set()
        self._variables = []
        self._skipped_at_start = 0
        # micro_batch_size="auto": the search, the step compiled for each size tried,
        # and what fit says about it.
        self.auto_size = AutoSize(options.max_micro_batch_size) if options.auto else None
        self._sized_steps = {}
        self._verbose = 0
        self._announced = None

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size of split mode: the one given, or the one `"auto"`
        chose (None before its first batch, and in `steps` mode)."""
        if self.auto_size is not None:
            return self.auto_size.chosen
        return self.options.micro_batch_size

    def attach(self, host, own_step=None) -> None:
        """`own_step`: the model's own `train_step(state, data)` (None: Keras's)."""
        if own_step is not None and self.options.split:
            raise ValueError(
                "On Keras's JAX backend a model's own `train_step` accumulates with "
                "`steps` (each batch is a micro-batch); split mode runs Keras's default "
                f"step. Received: micro_batch_size={self.options.micro_batch_size!r} "
                f"for model {host.name!r} of class {type(host).__name__}, which defines "
                "its own `train_step`."
            )
        self.host = host
        self.own_train_step = own_step

    def replicas(self) -> int:
        return 1

    def evaluating(self):
        return contextlib.nullcontext()

    def before_evaluate(self, kwargs) -> None:
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit sees the epoch's partial window applied.
            self.end_of_data()

    def open_micro_batches(self) -> int:
        if self.state is None:
            return 0
        return int(self.state.micro_step.numpy()) + int(self.state.window_skipped.numpy())

    # State --------------------------------------------------------------------------

    def ensure_state(self) -> None:
        """Creates the state (before the train function is made) and the step."""
        if self.state is not None:
            return
        host = self.host
        if not host.built:
            raise ValueError(
                "The model being trained must be built before its accumulation state is "
                f"created. Received: model {host.name!r} that is not built (fit builds "
                "it from its first batch: is the data empty?). Give the model an Input, "
                "or call it on a batch first."
            )
        if not host.trainable_variables:
            raise ValueError(
                "The model being trained must have trainable variables to accumulate "
                f"gradients of. Received: model {host.name!r} with none."
            )
        optimizer = host.optimizer
        private = self.options.privacy is not None
        if private:
            check_private_layers(host)
            if kc.is_loss_scale_optimizer(optimizer):
                raise ValueError(
                    "`privacy` needs an optimizer without loss scaling: each example's "
                    "gradient is clipped before the sum. Received: a LossScaleOptimizer "
                    "(the mixed_float16 policy); use mixed_bfloat16 or float32."
                )
        if not optimizer.built:
            optimizer.build(host.trainable_variables)
        terms = max(0, kc.count_compiled_losses(kc.compiled_loss(host)) - 1)
        self._variables = list(host.trainable_variables)
        self.state = AccumulationState(
            self._variables, self.options.accumulator_dtype, terms=terms,
            layouts=layouts_of(self._variables), split=self.options.split,
            private=private,
        )
        kc.model_metrics(host).append(self.state)
        self._restore_pending()

    def forget(self) -> None:
        """Drops the state and the step (a new compile); the open window's values wait
        for the state made before the next training."""
        if self.state is not None:
            saved = {
                name: v.numpy() for name, v in self.state.named().items()
                if name not in ("epoch_step", "resume_skip", "epoch_length")
            }
            # The window's sums by the variable they belong to.
            saved = _fit_common.keyed_by_variable(saved, self._variables)
            self._pending = {**saved, **self._pending}
            metrics = kc.model_metrics(self.host)
            metrics[:] = [m for m in metrics if m is not self.state]
        self.state = None
        self.step = None
        if self.host is not None:
            self.host.train_function = None
            if self._pending and self.host.built and self.host.optimizer is not None:
                # The open window lives on at once (seen by `save_weights`,
                # `disable` and `open_micro_batches` before the next fit).
                self.ensure_state()

    def detach(self) -> None:
        """`disable`: the model tracks the state no more."""
        if self.state is not None:
            metrics = kc.model_metrics(self.host)
            metrics[:] = [m for m in metrics if m is not self.state]
        self.state = None
        self.step = None

    def save_to(self, store) -> None:
        if self.state is None:
            return
        for name, variable in self.state.named().items():
            # The epoch's length is the running fit's (its hook sets it), never
            # a checkpoint's.
            if name != "epoch_length":
                store[f"gradaccum_{name}"] = np.asarray(variable.numpy())

    def load_from(self, store) -> None:
        # (`epoch_length` in a file saved before it was left out: ignored.)
        self._pending = {
            key[len("gradaccum_"):]: np.asarray(store[key])
            for key in store.keys()
            if key.startswith("gradaccum_") and key != "gradaccum_epoch_length"
        }
        if self._pending and getattr(self.host, "optimizer", None) is not None:
            self.ensure_state()
            self._restore_pending()

    def _restore_pending(self) -> None:
        if not self._pending or self.state is None:
            return
        pending = self._pending
        _fit_common.to_slots(pending, self._variables)
        _fit_common.restore(self.state.named(), pending)

    # fit ----------------------------------------------------------------------------

    def make_train_function(self, make, force=False):
        self.ensure_state()
        if self.step is None:
            self.step = TrainStep(self.host, self.options, self.state, self.normalizers,
                                  own_step=self.own_train_step)
            force = True
        self.step.resumable = self.resumable
        if self.auto_size is not None:
            if force or self.host.train_function is None:
                self._sized_steps = {}
                self.host.train_function = self.host._make_function(
                    retry.retrying(self, self._step_of_size)
                )
            return self.host.train_function
        make(force)
        return self.host.train_function

    def _step_of_size(self, size: int, donate: bool, state):
        """The step that splits batches into micro-batches of `size` samples,
        compiled as Keras compiles its own (the state donated where `donate`, laid
        out as `state`, the trainer's, is)."""
        if (size, donate) not in self._sized_steps:
            self._sized_steps[size, donate] = retry.compiled(
                self.host, lambda state, data: self.step(state, data, size), state, donate
            )
        return self._sized_steps[size, donate]

    def size_chosen(self) -> None:
        _fit_common.size_chosen(self)

    def train_step(self, state, data):
        return self.step(state, data)

    def fit(self, fit, x, y, batch_size, epochs, verbose, callbacks, kwargs):
        check_private_fit(self.options, x, batch_size)
        self._verbose = verbose
        hook = (_RaisingHook if self._raises() else EpochHook)(self)
        callbacks = _fit_common.begin_fit(self, hook, epochs, callbacks, kwargs)
        try:
            history = fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                          callbacks=callbacks, **kwargs)
        except BaseException:
            _fit_common.after_fit(self, failed=True)
            raise
        _fit_common.after_fit(self)
        return history

    def _raises(self) -> bool:
        options = self.options
        return (options.nonfinite == "raise" or callable(options.weighting)
                or callable(options.window.steps))

    def end_of_data(self) -> None:
        """The data ended: the open window is flushed or dropped as `partial` says
        (kept with `"carry"`)."""
        if self.state is None or self.options.partial == "carry":
            return
        if self.open_micro_batches() == 0:
            return
        if self.step is None:
            # A window restored (load_weights) and not trained on since.
            self.step = TrainStep(self.host, self.options, self.state, self.normalizers,
                                  own_step=self.own_train_step)
        self.step.close_eagerly(apply=self.options.partial == "flush")

    def after_train_on_batch(self, logs):
        """`train_on_batch`: its logs without the step's error entry, and the error
        raised."""
        if isinstance(logs, dict):
            logs.pop(ERROR_KEY, None)
        if self.state is not None:
            self.raise_step_error()
        return logs

    def raise_step_error(self) -> None:
        """Raises the error the jitted step recorded (and clears it)."""
        state = self.state
        error = int(state.error.numpy())
        if not error:
            return
        at = int(state.error_at.numpy())
        state.error.assign(0)
        errors = AccumulationState.ERRORS
        if error == errors["nonfinite"]:
            raise FloatingPointError(raise_message(int(state.error_micro_batch.numpy()), at))
        if error == errors["negative_weight"]:
            raise ValueError(
                f"{NEGATIVE_WEIGHT}. Received: a negative weight for micro-batch {at} "
                "of its window (it was accumulated with weight 0)."
            )
        raise ValueError(
            f"{SCHEDULE_RULE} Received: a value < 1 for update_index={at} (that "
            "window held 1 micro-batch)."
        )

    def write_logs(self, logs) -> None:
        if logs is None or self.state is None:
            return
        state = self.state
        logs.pop(ERROR_KEY, None)
        counted = self.step.primary_optimizer if self.step else self.host.optimizer
        logs["updates"] = float(counted.iterations.numpy())
        logs["window_micro_batches"] = float(state.last_window_micro_batches.numpy())
        logs["window_weight"] = float(state.last_window_weight.numpy())
        if self.micro_batch_size is not None and self.auto_size is not None:
            logs["micro_batch_size"] = float(self.micro_batch_size)
        loss_scaled = kc.is_loss_scale_optimizer(self.host.optimizer)
        if self.options.nonfinite != "apply" or loss_scaled:
            logs["skipped"] = float(state.skipped.numpy())
        privacy = self.options.privacy
        if privacy is not None and privacy.logs_epsilon:
            logs["epsilon"] = spent(self)

    def privacy_record(self) -> tuple[int, float]:
        """With privacy: the updates made and the most examples a window held."""
        if self.state is None:
            return 0, 0.0
        return int(self.state.updates.numpy()), float(self.state.largest_window.numpy())

    # The audit ----------------------------------------------------------------------

    def window_gradients(self) -> list:
        """The open window's combined gradient: `(variable, value)` per trainable
        variable (`gradaccum.audit`)."""
        from gradaccum.core.combine import combine

        if self.state is None:
            return []
        named = self.state.named()
        sums = [named[f"accumulator_{i}"].value for i in range(len(self._variables))]
        combined = combine(sums, named["total_weight"].value, self.options.reduction,
                           [v.dtype for v in self._variables])
        return list(zip(self._variables, combined))

    def audit_findings(self) -> dict:
        """What the accumulation saw that makes it differ from the large batch."""
        state = self.state
        step = self.step
        optimizers = []
        if step is not None and self.own_train_step is not None:
            optimizers = [kc.optimizer_name(self.host, a.optimizer) for a in step.appliers]
        return {"repeated": [], "optimizers": optimizers,
                "inexact": bool(state is not None and state.inexact.numpy()),
                "skipped": 0 if state is None else int(state.skipped.numpy())}

    def warn(self) -> None:
        state = self.state
        if state is None:
            return
        if bool(state.inexact.numpy()) and "inexact" not in self._warned:
            self._warned.add("inexact")
            _fit_common.warn_inexact(stacklevel=4)
        skipped = int(state.skipped.numpy())
        # Loss scaling skips overflowing micro-batches by design: no warning.
        if (self.options.nonfinite == "skip" and skipped > self._skipped_at_start
                and not kc.is_loss_scale_optimizer(self.host.optimizer)
                and "skipped" not in self._warned):
            self._warned.add("skipped")
            warn_skipped(skipped - self._skipped_at_start, stacklevel=3)


class EpochHook(keras.callbacks.Callback):
    """Runs first among fit's callbacks: the epoch's position and length, the window
    the data ends in, and the epoch's `updates` / `skipped` log entries."""

    def __init__(self, accumulation: Accumulation):
        super().__init__()
        self.accumulation = accumulation
        self.epochs_to_run = True
        self.batches = 0
        self.first_epoch = True

    def _synced_state(self):
        # Reading `self.model` syncs the trainer's state into the model's variables.
        _ = self.model
        return self.accumulation.state

    def on_train_begin(self, logs=None):
        state = self._synced_state()
        steps = (self.params or {}).get("steps")
        state.epoch_length.assign(int(steps) if steps else -1)
        self.accumulation._skipped_at_start = int(state.skipped.numpy())
        self.first_epoch = True
        self.batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        state = self._synced_state()
        if self.first_epoch and int(state.epoch_step.numpy()) > 0:
            # Restored (BackupAndRestore) inside an epoch: the epoch restarts from
            # its first batch, so skip what was already trained on.
            state.resume_skip.assign(state.epoch_step.numpy())
        state.epoch_step.assign(0)
        self.first_epoch = False

    def on_train_batch_begin(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        state = self._synced_state()
        accumulation = self.accumulation
        if logs is not None:
            logs.pop(ERROR_KEY, None)
        accumulation.raise_step_error()
        accumulation.end_of_data()
        state.epoch_step.assign(0)
        accumulation.write_logs(logs)
        accumulation.warn()

    def on_train_end(self, logs=None):
        self._synced_state()
        self.accumulation.end_of_data()
        # (After it, `_fit_common.after_fit` leaves the epoch.)
        if self.batches == 0 and self.epochs_to_run:
            raise ValueError(_fit_common.EMPTY_FIT)


class _RaisingHook(EpochHook):
    """The hook when the step can record an error (`nonfinite="raise"`, a weighting
    or schedule callable): checked after every call of the jitted step."""

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None and logs.pop(ERROR_KEY, 0):
            self._synced_state()
            self.accumulation.raise_step_error()
