"""Accumulation inside Keras's `fit()` on TensorFlow: one mechanism for `accumulate` and `wrap`.

`Accumulation` attaches to the model being trained (the *host*): the user's own
model (`gradaccum.accumulate`) or `wrap`'s `AccumulatingModel`. It holds the
options and the accumulation state (`state.FitState`) and runs one of three steps:

- a host that uses Keras's default `train_step` trains with gradaccum's exact step
  (`step.py`);
- a host whose class defines its own `train_step` runs it unchanged, its optimizer
  calls accumulated (`own_step.py`);
- split mode cuts each batch into micro-batches inside the step (`split_step.py`).

What a micro-batch does to its window is `gradaccum.core.transitions`; what `fit`
does alike on every backend (its epochs, the logs, saving) is the base class's,
`gradaccum.adapter.Accumulation`. Here: the state (`state.FitState`), the steps,
the epoch's end, resuming under `BackupAndRestore` inside the step (`resume.py`),
and the log entries packed in the step (`logs.py`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from gradaccum import adapter
from gradaccum.backend_interface import Findings
from gradaccum.backends.tensorflow import following, resume
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import logs as _logs
from gradaccum.backends.tensorflow import retry as _retry
from gradaccum.backends.tensorflow.accumulator import GradientAccumulator
from gradaccum.backends.tensorflow.distributed import (
    check_split_synchronization,
    distribution_of,
)
from gradaccum.backends.tensorflow.finite import compiled_raise_message
from gradaccum.backends.tensorflow.own_step import OwnStep
from gradaccum.backends.tensorflow.record import ModuleRecord, Runner
from gradaccum.backends.tensorflow.split_step import split_step
from gradaccum.backends.tensorflow.state import FitState, Untracked
from gradaccum.backends.tensorflow.step import exact_step
from gradaccum.core.options import Options


class Accumulation(adapter.Accumulation):
    """Gradient accumulation attached to a model that `fit` trains on TensorFlow (the
    adapter: `gradaccum.adapter.Accumulation`).

    Args:
        options: the checked `Options`.
        layers: the model whose `gradaccum.BatchNormalization` layers the exact
            step drives (the host itself, or `wrap`'s inner model).
    """

    backend_name = "TensorFlow"
    runner = Runner()

    def __init__(self, options: Options, layers):
        super().__init__(options, layers)
        self.state: FitState | None = None
        self._end_of_data_function: Callable[[], Any] | None = None
        # What runs the host's own `train_step` with its optimizer calls accumulated.
        self.own_step = OwnStep(self)
        # Split mode: whether XLA compiles each micro-batch (the host's jit_compile).
        self.micro_batch_jit = False

    def new_accumulator(self, variables, *, layers=None, name="gradient_accumulator"):
        """A new accumulator of `variables` under the options (its layers'
        windows emptied; with privacy, the noise's seed)."""
        accumulator = GradientAccumulator(
            variables,
            steps=self.options.window,
            reduction=self.options.reduction,
            accumulator_dtype=self.options.accumulator_dtype,
            layers=layers,
            nonfinite=self.options.nonfinite,
            noise_scale=self.options.noise_scale,
            name=name,
        )
        # A new accumulator's window is empty: so are the windows of the layers it
        # drives. Whatever their state variables held (values left by an earlier
        # accumulation, or written by `set_weights`, whose list includes them) would
        # otherwise be pooled into the first window. A saved window is restored
        # afterwards (`Accumulation.restore_pending`), with the accumulator's.
        for layer in accumulator.batch_normalization_layers:
            layer._reset_window()
        if self.options.privacy is not None:
            accumulator._privacy = Untracked(self.options.privacy)
            # A variable made in the strategy's scope: under several workers its
            # initial value is the chief's, so every worker draws the same noise.
            accumulator._noise_seed = tf.Variable(
                self.options.privacy.noise_seed(), dtype=tf.int64, trainable=False,
                name="noise_seed",
            )
        return accumulator

    @classmethod
    def check_model(cls, model) -> None:
        """Checks a built model's variables where `accumulate` and `wrap` receive it (one
        tf.distribute strategy for all of them)."""
        distribution_of(model.trainable_variables)

    def detach(self) -> None:
        """`disable`: nothing of the state lives in the host on TensorFlow."""

    def replicas(self) -> int:
        """Replicas the host trains on (its strategy's)."""
        return self.host.distribute_strategy.num_replicas_in_sync

    def evaluating(self):
        """The context `evaluate` runs in (each worker's own evaluation under
        MultiWorkerMirroredStrategy)."""
        stack = contextlib.ExitStack()
        stack.enter_context(kc.across_workers(self.host))
        stack.enter_context(super().evaluating())
        return stack

    # fit -----------------------------------------------------------------------

    def building(self):
        """An unbuilt model that trains with Keras's default step is built from its
        first batch before the function is made (`kc.built_before_tracing`); a
        model's own step is left to build what it builds in its first run."""
        if self.own_train_step is not None:
            return contextlib.nullcontext()
        return kc.built_before_tracing(self.host)

    def fitting(self, hook):
        """`fit` runs across workers (Keras 3.15's multi-worker fit), telling the
        hook the epoch's length as Keras's epoch iterator counts it."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.building())
        stack.enter_context(kc.across_workers(self.host))
        stack.enter_context(super().fitting(hook))
        return stack

    def batch_end_async_safe(self) -> bool:
        # Under XLA the step's assertion is compiled away: the hook raises after
        # the call that skipped, before the next runs.
        return not self._raises_after_the_call()

    def _raises_after_the_call(self) -> bool:
        return self.options.nonfinite == "raise" and bool(self.host.jit_compile)

    def after_batch(self, hook, logs, deferred: bool = False) -> None:
        # Named before the callbacks after the hook see them (logs that reach the
        # callbacks packed: under several workers).
        _logs.unpacked(logs)
        if self._raises_after_the_call():
            # XLA compiles the step's assertion away (the micro-batch is skipped
            # instead): raise here, after the compiled call.
            skipped = self.skipped() - self.skipped_at_start
            if skipped:
                raise tf.errors.InvalidArgumentError(
                    None, None, compiled_raise_message(skipped)
                )

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

    def fit_record(self):
        """The fit record (`core.state.FIT`) the state machine reads and writes."""
        return ModuleRecord(self.state)

    def end_of_data(self) -> None:
        """Closes the open windows as `partial` says (idempotent)."""
        if self.state is None or self.options.partial == "carry":
            return
        host = self.host
        if self._end_of_data_function is None:
            pairs = [(self.state.accumulator, host.optimizer)] if self.state.accumulator else []
            pairs += [(acc, optimizer) for acc, optimizer in self.state.own]

            def close():
                applied = []
                for acc, optimizer in pairs:
                    if self.options.partial == "flush":
                        applied.append(acc.close(optimizer, True, True,
                                                 fit=self.fit_record()))
                    else:
                        acc.drop()
                        applied.append(tf.constant(False))
                if applied:
                    # The window's moving statistics move with its update (flush),
                    # or are forgotten with it (drop).
                    following.settle(self, applied[0])
                return tf.constant(True)

            # Without AutoGraph, as Keras traces its train step (`do_not_convert`):
            # the close is the step's own code, written with TensorFlow's ops; the
            # conversion cost a process's first fit about 2 s, each later one 0.1 s.
            # Traced once per state. TensorFlow counts traces by the Python
            # function's code, which every model's `close` shares: given as a
            # partial (a key of its own), a process that trains many models is not
            # warned of retracing.
            self._end_of_data_function = (
                close if host.run_eagerly
                else tf.function(functools.partial(close), autograph=False))
        with host.distribute_strategy.scope():
            self._end_of_data_function()

    # State -----------------------------------------------------------------------

    def ensure_state(self) -> None:
        """Creates the accumulation state before the train function is traced."""
        if self.state is not None:
            return
        host = self.host
        layers = self.layers
        check_sums(self.options.sums, host.distribute_strategy)
        if self.options.split:
            check_split_synchronization(
                host.distribute_strategy, kc.flatten_layers(layers),
                self.options.micro_batch_size,
            )
        follower = self.follow()
        if self.own_train_step is not None and not host.built:
            # A subclassed model with its own step is built by its first step:
            # its accumulators are made when the step hands gradients over.
            self.state = FitState(None)
            self.restore_pending()
            return
        terms = self.check_trainable()
        with host.distribute_strategy.scope():
            distribution_of(host.trainable_variables)
            if host.optimizer is not None and not host.optimizer.built:
                # Before tracing: a loss scale read in the step must be a variable.
                host.optimizer.build(host.trainable_variables)
            accumulator = None
            if self.own_train_step is None:
                accumulator = self.new_accumulator(host.trainable_variables,
                                                       layers=layers)
            self.state = FitState(accumulator, terms=terms,
                                  private=self.options.privacy is not None,
                                  statistics=follower.fields())
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

    def drop_state(self) -> None:
        self.state = None
        self.own_step.handed = []
        self._end_of_data_function = None

    def fit_field(self, name: str):
        return getattr(self.state, name)

    def saved_variables(self) -> dict:
        return {} if self.state is None else self.state.saved_variables()

    def windows(self) -> list:
        """Each accumulator's variables with the prefix of its names in
        `saved_variables`: the exact step's, then a model's own step's."""
        state = self.state
        assert state is not None, "called with a state (adapter.Accumulation checks)"
        pairs = [] if state.accumulator is None else [("", state.accumulator)]
        pairs += [(f"own_{j}_", acc) for j, (acc, _) in enumerate(state.own)]
        return [(prefix, acc.target_variables, ("received",)) for prefix, acc in pairs]

    def window_values(self, name: str) -> list:
        assert self.state is not None, "called with a state (adapter.Accumulation checks)"
        return [int(getattr(acc.state, name).numpy()) for acc in self.state.accumulators()]

    # Logs --------------------------------------------------------------------------

    def logged_prefix(self) -> str:
        return _logs.logged_prefix(self)

    def last_window(self) -> tuple:
        optimizer = _logs.updating_optimizer(self)
        window = _logs.last_window(self)
        return (
            None if optimizer is None else optimizer.iterations.numpy(),
            window["window_micro_batches"].numpy() if window else 0,
            window["window_weight"].numpy() if window else 0,
        )

    def repeat_warning(self) -> str | None:
        return self.own_step.repeat_warning()

    # The audit and privacy ----------------------------------------------------------

    def window_gradients(self) -> list:
        """The open window's combined gradient: `(variable, value or None)` per
        variable of every accumulator (`gradaccum.audit`)."""
        if self.state is None:
            return []
        pairs = []
        for acc in self.state.accumulators():
            pairs += list(zip(acc.target_variables, acc.gradients()))
        return pairs

    def findings(self) -> Findings:
        host = self.host
        return Findings(
            repeated=list(self.own_step.repeated),
            # Optimizer calls whose gradients depend on an earlier call's update.
            stale=[(kc.optimizer_name(host, a), kc.optimizer_name(host, b))
                   for a, b in self.own_step.stale],
            stale_known=True,
            optimizers=[kc.optimizer_name(host, o) for o in self.own_step.handed],
            inexact=bool(self.state is not None and self.state.inexact.numpy()),
            skipped=self.skipped(),
        )

    def privacy_record(self) -> tuple[int, float]:
        """With privacy: the updates made and the most examples a window held."""
        state = self.state
        if state is None or state.accumulator is None:
            # After a compile the values wait for the next state.
            pending = self._pending
            return (int(np.asarray(pending.get("updates", 0))),
                    float(np.asarray(pending.get("largest_window", 0.0))))
        return int(state.accumulator.updates.numpy()), float(state.largest_window.numpy())


def check_sums(sums: str, strategy) -> None:
    """`sums` other than "local" under a tf.distribute strategy of several replicas:
    refused with the way out (each replica keeps whole sums, added once per update;
    sharding them is JAX's keras.distribution's and PyTorch DDP's)."""
    replicas = strategy.num_replicas_in_sync
    if sums == "local" or replicas < 2:
        return
    raise ValueError(
        f'`sums` must be "local" under tf.distribute: each replica keeps whole sums of '
        f"its own micro-batches, added once per update. Received: sums={sums!r} under "
        f"{type(strategy).__name__} with {replicas} replicas. Pass sums=\"local\"; "
        'sums="sharded" runs on JAX under keras.distribution and on PyTorch under '
        "DistributedDataParallel (GradientAccumulator)."
    )
