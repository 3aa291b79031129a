"""Accumulation inside Keras's `fit()` on JAX: the adapter
(`gradaccum.adapter.Accumulation`) `accumulate` and `wrap` attach to a model.

`Accumulation` owns the state (`AccumulationState`, a metric the model tracks, so
the JAX trainer carries it through its jitted step) and the step (`TrainStep`);
what `fit` does alike on every backend (its epochs, logs, saving) is the base
class's. Here: where the state lives, closing a window outside the step at the end
of the data, and raising the errors the jitted step can only record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum import _keras_common as kc
from gradaccum import adapter
from gradaccum.backend_interface import Findings
from gradaccum.backends.jax import device_sums, phases, retry
from gradaccum.backends.jax.own_step import Applier
from gradaccum.backends.jax.phases import Phases
from gradaccum.backends.jax.record import Carry, FitRecord, Runner
from gradaccum.backends.jax.state import AccumulationState, layouts_of, window_prefix
from gradaccum.backends.jax.step import ERROR_KEY, TrainStep
from gradaccum.core import messages
from gradaccum.core import transitions as tr
from gradaccum.core.host_window import HostWindow
from gradaccum.core.options import Options
from gradaccum.core.validation import accumulator_dtype_name


def check_accumulator_dtype(accumulator_dtype) -> str:
    """The accumulator dtype's name, refused where JAX does not compute in it
    (float64 without 64-bit mode)."""
    name = accumulator_dtype_name(accumulator_dtype)
    # JAX's Config sets its flags as attributes at run time; its hints do not list them.
    if name == "float64" and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        raise ValueError(
            "`accumulator_dtype` must be a dtype JAX computes in: float64 needs "
            "jax.config.update('jax_enable_x64', True) before the model is made "
            "(without it JAX keeps float32). Received: accumulator_dtype='float64'"
        )
    return name


def check_model(model) -> None:
    """Nothing to check on JAX where `accumulate` and `wrap` receive a built model."""


class Accumulation(adapter.Accumulation):
    """Gradient accumulation attached to a model that `fit` trains on JAX (the
    adapter: `gradaccum.adapter.Accumulation`).

    Args:
        options: the checked `Options`.
        layers: the model trained (the host itself, or `wrap`'s inner model).
    """

    backend_name = "JAX"
    runner = Runner()
    splits_own_step = False

    @classmethod
    def check_options(cls, options: Options) -> None:
        """float64 accumulators need JAX's 64-bit mode."""
        check_accumulator_dtype(options.accumulator_dtype)

    def __init__(self, options: Options, layers):
        super().__init__(options, layers)
        self.state: AccumulationState | None = None
        self.step: TrainStep | None = None
        self._variables: list = []
        # micro_batch_size="auto": the step compiled for each size tried.
        self._sized_steps: dict[tuple[int, bool], Any] = {}
        # Whether a compiled call's logs showed the step's error flag (raised in
        # the fit's thread).
        self._pending_error: bool | None = None
        # close_eagerly's jitted closes by (record, applied), for the step of the
        # state (a fit whose data ends each epoch compiles them once, not once per
        # epoch); let go with the state.
        self._closers: dict[tuple[int, bool], Any] = {}
        # The step without the close and the whole one, chosen on the host, where
        # the window's length is fixed (`phases.py`); None otherwise.
        self._phases: Phases | None = None
        # Whether to run them (None: where they pay, `phases.worth_it`): benchmarks
        # set it to measure one against the other.
        self.phases_wanted: bool | None = None

    def detach(self) -> None:
        """`disable`: the model tracks the state no more."""
        self._untrack()
        self.state = None
        self.step = None
        self._closers = {}
        self._phases = None

    def _untrack(self) -> None:
        if self.state is not None:
            metrics = kc.model_metrics(self.host)
            metrics[:] = [m for m in metrics if m is not self.state]

    # State --------------------------------------------------------------------------

    def ensure_state(self) -> None:
        """Creates the state (before the train function is made) and the step."""
        if self.state is not None:
            return
        host = self.host
        terms = self.check_trainable()
        optimizer = host.optimizer
        private = self.options.privacy is not None
        if not optimizer.built:
            optimizer.build(host.trainable_variables)
        self._variables = list(host.trainable_variables)
        follower = self.follow()
        # A window record per optimizer the model holds (a model's own step may
        # hand gradients to any of them).
        records = len(kc.named_optimizers(host)) if self.own_train_step is not None else 1
        layouts = layouts_of(self._variables)
        # Under a keras.distribution's batch axis: the sums kept per device, reduced
        # once per update (`device_sums`), where the model allows.
        rows = device_sums.plan(host, self.options, self._variables, layouts, follower,
                                self.own_train_step)
        self.state = AccumulationState(
            self._variables, self.options.accumulator_dtype, terms=terms,
            layouts=layouts, split=self.options.split,
            private=private, records=max(1, records), statistics=follower.fields(),
            rows=rows, noise=self.options.noise_scale,
        )
        kc.model_metrics(host).append(self.state)
        self.restore_pending()

    def drop_state(self) -> None:
        """Drops the state and the step (a new compile); the open window's values wait
        for the state made before the next training."""
        self._untrack()
        self.state = None
        self.step = None
        self._closers = {}
        self._phases = None
        if self.host is not None:
            self.host.train_function = None

    def fit_field(self, name: str):
        assert self.state is not None, "called with a state"
        return self.state.named()[name]

    def saved_variables(self) -> dict:
        return {} if self.state is None else self.state.named()

    def windows(self) -> list:
        # One set of sums, whichever record's window each belongs to.
        return [("", self._variables, ())]

    def window_values(self, name: str) -> list:
        assert self.state is not None, "called with a state (adapter.Accumulation checks)"
        named = self.state.named()
        return [int(named[window_prefix(j) + name].numpy()) for j in range(self.state.records)]

    # fit ----------------------------------------------------------------------------

    def make_train_function(self, make, force=False):
        self.ensure_state()
        if self.step is None:
            self.step = TrainStep(self.host, self.options, self.state, self.normalizers,
                                  own_step=self.own_train_step, follower=self.follower)
            force = True

            # A new function object for Keras to jit: JAX keeps a function's trace
            # by the function, so the one installed at attach would replay the step
            # of the first compile after a recompile (its loss, its optimizer).
            def train_step(state, data):
                return self.train_step(state, data)

            self.host.__dict__["train_step"] = train_step
        self.step.resumable = self.resumable
        if self.auto_size is not None:
            if force or self.host.train_function is None:
                self._sized_steps = {}
                self.host.train_function = self.host._make_function(
                    retry.retrying(self, self._step_of_size)
                )
            return self.host.train_function
        if self.phased():
            if force or self.host.train_function is None or self._phases is None:
                self._phases = Phases(self)
                self.host.train_function = self.host._make_function(self._phases)
            return self.host.train_function
        if self._phases is not None:
            self._phases = None
            force = True  # the function installed is the two steps'
        make(force)
        return self.host.train_function

    def phased(self) -> bool:
        """Whether `fit` runs the step without the close where the host knows no
        window closes (`phases.py`): Keras's step, one micro-batch per batch, and
        windows of a fixed length of several."""
        step = self.step
        wanted = phases.worth_it() if self.phases_wanted is None else self.phases_wanted
        return (wanted and step is not None and step.own_step is None
                and not self.options.split and not step.direct
                and HostWindow.follows(self.options.window))

    @contextlib.contextmanager
    def fitting(self, hook):
        try:
            with super().fitting(hook):
                yield
        finally:
            if self._phases is not None:
                # Outside fit (train_on_batch) every micro-batch may close.
                self._phases.window.forget()

    def restore_pending(self) -> None:
        super().restore_pending()
        if self._phases is not None:
            # Values from outside (load_weights): counted again as the next epoch
            # begins, every micro-batch may close until then.
            self._phases.window.forget()

    def epoch_began(self, hook, resume_skip: int) -> None:
        """The host's count of the window starts from the state (one read per
        epoch), after the hook set the epoch's fields; the restored micro-batches
        are passed over where the step passes over them (`TrainStep.pass_over_restored`)."""
        if self._phases is None or self.state is None or self.step is None:
            return
        skip = resume_skip if self.step.passes_over_restored else 0
        # The epoch's length is the one the hook gave the state as the fit began.
        self._phases.window.start(self.open_micro_batches(), self.epoch_length(hook), skip)

    def _step_of_size(self, size: int, donate: bool, state):
        """The step that splits batches into micro-batches of `size` samples,
        compiled as Keras compiles its own (the state donated where `donate`, laid
        out as `state`, the trainer's, is)."""
        if (size, donate) not in self._sized_steps:

            def sized(state, data):
                assert self.step is not None, "made by make_train_function"
                return self.step(state, data, size)

            self._sized_steps[size, donate] = retry.compiled(self.host, sized, state, donate)
        return self._sized_steps[size, donate]

    def train_step(self, state, data):
        return self.step(state, data)

    def synced(self, hook) -> None:
        # Reading `hook.model` syncs the trainer's state into the model's variables.
        _ = hook.model

    def after_batch(self, hook, logs, deferred: bool = False) -> None:
        """The step can record an error (`nonfinite="raise"`, a weighting or schedule
        callable): raised after the call that met it.

        Keras hands the hook each call's logs as Python numbers, read in its worker
        thread while the next calls are dispatched (`deferred`): there the error is
        only noted, and raised in the fit's thread as the next call begins (or at
        the epoch's end). A step after an error accumulates and applies nothing, so
        the weights and the state stay as the error left them.
        """
        flag = logs.pop(ERROR_KEY, None) if isinstance(logs, dict) else None
        if flag is not None and bool(flag):
            self._pending_error = True
        if not deferred:
            self.before_batch(hook)

    def before_batch(self, hook) -> None:
        if self._pending_error:
            self._pending_error = None
            self.synced(hook)
            self.raise_step_error()

    def before_evaluate(self, kwargs) -> None:
        # Validation inside fit comes before the epoch's end: an error of the last
        # call is raised before the open window is applied (the state is synced).
        # Keras's worker may not have read the last call's logs yet: the state
        # (synced by Keras before validation) says.
        if kwargs.get("_use_cached_eval_dataset"):
            self._pending_error = None
            if self.state is not None:
                self.raise_step_error()
        super().before_evaluate(kwargs)

    def fit_failed(self) -> None:
        # A fit that ended by another error (a callback's, Ctrl-C) before the flag
        # was read: its step error goes with it, not into the next fit.
        pending, self._pending_error = self._pending_error, None
        if pending and self.state is not None:
            self.state.error.assign(0)

    def end_of_data(self) -> None:
        """The data ended: the open window is flushed or dropped as `partial` says
        (kept with `"carry"`)."""
        if self.state is None:
            return
        if self._phases is not None and self._phases.window.known:
            # A step without the close that met a due window: raised here, where
            # no other policy would raise it.
            if int(self.state.error.numpy()) == AccumulationState.ERRORS["miscount"]:
                self._phases.window.forget()
                self.raise_step_error()
        if self.options.partial == "carry" or self.open_micro_batches() == 0:
            return
        if self.step is None:
            # A window restored (load_weights) and not trained on since.
            self.step = TrainStep(self.host, self.options, self.state, self.normalizers,
                                  own_step=self.own_train_step, follower=self.follower)
        self.close_eagerly(apply=self.options.partial == "flush")
        if self._phases is not None:
            self._phases.window.closed()

    def close_eagerly(self, apply: bool) -> bool:
        """Closes the open windows outside the step (the end of the data): each is
        applied when `apply` and it holds an accepted micro-batch, else dropped.
        Returns whether an update happened."""
        step = self.step
        assert step is not None, "made by end_of_data"
        if not step.appliers_known:
            self.warn_appliers_unknown()
            return False
        closed = [self._close_record(index, applier, apply)
                  for index, applier in sorted(step.appliers.items())]
        if closed and closed[0] is not None:
            # The window's moving statistics move with its update, or are forgotten.
            self.settle_moving_statistics(closed[0])
        return any(bool(c) for c in closed)

    def settle_moving_statistics(self, applied: bool) -> None:
        """A window closed outside the step: its followed layers' moving statistics
        moved once where `applied`, its statistics emptied."""
        follower = self.follower
        if not follower:
            return
        assert self.state is not None, "called with a state"
        named = self.state.named()
        start = [(mean.value, variance.value) for mean, variance in follower.moving()]
        statistics, values = follower.step({n: named[n].value for n in follower.names()},
                                           start, None, False, applied, True)
        for name, value in statistics.items():
            named[name].assign(value)
        for (mean, variance), (new_mean, new_variance) in zip(follower.moving(), values):
            mean.assign(new_mean)
            variance.assign(new_variance)

    def _close_record(self, index, applier, apply: bool) -> bool | None:
        """`close_eagerly` for window record `index` (one jitted call): whether it
        applied an update (None: its window was empty)."""
        model = self.host
        optimizer = applier.optimizer
        state = self.state
        assert state is not None, "called with a state"
        fields = state.carried()
        window = state.unpack({name: v.value for name, v in fields.items()})
        prefix = window_prefix(index)
        if int(window[prefix + "micro_step"]) + int(window[prefix + "window_skipped"]) == 0:
            return None

        trainable, optimizer_variables, window, applied = self._closer(index, applier, apply)(
            [v.value for v in model.trainable_variables],
            [v.value for v in optimizer.variables], window,
        )
        for v, value in zip(model.trainable_variables, trainable):
            v.assign(value)
        for v, value in zip(optimizer.variables, optimizer_variables):
            v.assign(value)
        for name, value in state.pack(window).items():
            fields[name].assign(value)
        return bool(applied)

    def _closer(self, index, applier, apply: bool):
        """The jitted close of window record `index` (applied or dropped), made once
        per step (a new step comes with a new state: `drop_state`)."""
        step = self.step
        closers = self._closers
        if (index, apply) not in closers:
            renumbered = applier.renumbered(0)

            def close(trainable, optimizer_variables, window):
                carry = Carry(trainable, [], optimizer_variables, [], window)
                record = step.record(carry, index, renumbered)
                if apply:
                    applied = tr.apply_now(self.policy, record, True, fit=FitRecord(carry))
                else:
                    tr.drop(record)
                    applied = jnp.asarray(False)
                return carry.trainable, carry.optimizer, carry.fields, applied

            closers[index, apply] = jax.jit(close)
        return closers[index, apply]

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
        assert state is not None, "called with a state"
        error = int(state.error.numpy())
        if not error:
            return
        at = int(state.error_at.numpy())
        state.error.assign(0)
        message = messages.error_message(error, int(state.error_micro_batch.numpy()), at)
        if error == AccumulationState.ERRORS["nonfinite"]:
            raise FloatingPointError(message)
        if error == AccumulationState.ERRORS["miscount"]:
            raise RuntimeError(message)
        if error == AccumulationState.ERRORS["schedule"]:
            message += " (that window held 1 micro-batch)."
        raise ValueError(message)

    # Logs ---------------------------------------------------------------------------

    def logged_prefix(self) -> str:
        if self.step is not None and self.step.appliers:
            return window_prefix(self.step.primary_index)
        return ""

    def last_window(self) -> tuple:
        assert self.state is not None, "called with a state"
        named = self.state.named()
        if self.step is not None and self.step.appliers:
            index = self.step.primary_index
            optimizer = self.step.primary_optimizer
        else:
            index, optimizer = 0, self.host.optimizer
        prefix = window_prefix(index)
        return (optimizer.iterations.numpy(),
                named[prefix + "last_window_micro_batches"].numpy(),
                named[prefix + "last_window_weight"].numpy())

    # The audit and privacy ------------------------------------------------------------

    def window_gradients(self) -> list:
        """The open window's combined gradient: `(variable, value)` per trainable
        variable (`gradaccum.audit`)."""
        from gradaccum.core.combine import combine

        if self.state is None:
            return []
        named = self.state.named()
        appliers: Mapping[int, Applier | None] = (
            self.step.appliers if self.step is not None else {})
        if not appliers:
            appliers = {0: None}
        pairs = []
        for j, applier in sorted(appliers.items()):
            slots = range(len(self._variables)) if applier is None else applier.variable_slots
            variables = [self._variables[i] for i in slots]
            combined = combine(
                [named[f"accumulator_{i}"].value for i in slots],
                named[window_prefix(j) + "total_weight"].value, self.options.reduction,
                [v.dtype for v in variables],
            )
            pairs += list(zip(variables, combined))
        return pairs

    def findings(self) -> Findings:
        step = self.step
        optimizers = []
        if step is not None and self.own_train_step is not None:
            optimizers = [kc.optimizer_name(self.host, a.optimizer)
                          for _, a in sorted(step.appliers.items())]
        return Findings(repeated=[], stale=[], stale_known=False, optimizers=optimizers,
                        inexact=bool(self.state is not None and self.inexact()),
                        skipped=self.skipped())

    def privacy_record(self) -> tuple[int, float]:
        """With privacy: the updates made and the most examples a window held."""
        if self.state is None:
            return 0, 0.0
        return int(self.state.updates.numpy()), float(self.state.largest_window.numpy())
