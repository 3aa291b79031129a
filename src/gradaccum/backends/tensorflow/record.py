"""The state machine's window record on TensorFlow: a `GradientAccumulator`'s
variables, and TensorFlow's primitives for `gradaccum.core.transitions`.

- Fields are `tf.Variable`s (`state.AccumulatorState`): read, assigned, added to
  in place.
- The sums' add is in place, a sparse gradient (`tf.IndexedSlices`) scatter-added,
  never densified (`combine.add_micro_batch`), inside a `tf.cond` on the screen.
- A window's close runs in one functional `If` kept whole (`branching.cond_kept_whole`):
  most micro-batches close nothing, and their step does not walk the update's
  nodes.
- An error raises: eagerly at once, in a traced step as a graph assertion every
  later write of the micro-batch waits for (XLA drops assertions: `fit` raises
  after a compiled call instead).
- `gradaccum.BatchNormalization` layers the accumulator drives keep their window
  beside the sums: pooled on accept, dropped on a skip, committed by the update,
  emptied with the window.

Under a tf.distribute strategy the close is `replicas.close`: the one reduction.

`Runner` runs a `steps` callable in the traced step (a `tf.function`, AutoGraph on).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from gradaccum.backend_interface import Record
from gradaccum.backends.tensorflow import finite
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import sums as _sums
from gradaccum.backends.tensorflow.branching import cond_kept_whole
from gradaccum.core import messages, overwrite
from gradaccum.core.state import RESET
from gradaccum.core.window import SCHEDULE_RULE, ScheduleRunner


def _static(value):
    """A Python bool for a constant predicate, else None."""
    if isinstance(value, bool):
        return value
    return tf.get_static_value(value)


class ModuleRecord(Record):
    """A record whose fields are a `tf.Module`'s variables, by attribute name (an
    attribute that is None is a field the record does not keep).

    Args:
        module: the module (`state.AccumulatorState`, `state.FitState`).
    """

    def __init__(self, module):
        self.state = module
        self.checks = []

    @contextlib.contextmanager
    def _after_checks(self):
        """Writes wait for the micro-batch's assertions (a failed one stops them)."""
        with tf.control_dependencies(self.checks):
            yield

    def cond(self, pred, true_fn, false_fn):
        with self._after_checks():
            return tf.cond(pred, true_fn, false_fn)

    def checked(self, value):
        if not self.checks:
            return value
        with tf.control_dependencies(self.checks):
            return tf.identity(value)

    def has(self, name: str) -> bool:
        return getattr(self.state, name, None) is not None

    def get(self, name: str):
        return tf.convert_to_tensor(getattr(self.state, name))

    def set(self, name: str, value) -> None:
        variable = getattr(self.state, name)
        with self._after_checks():
            variable.assign(tf.cast(value, variable.dtype))

    def add(self, name: str, delta) -> None:
        variable = getattr(self.state, name)
        with self._after_checks():
            variable.assign_add(tf.cast(delta, variable.dtype))


class VariableRecord(ModuleRecord):
    """A `GradientAccumulator`'s window record on one device.

    Args:
        accumulator: the `GradientAccumulator`.
        optimizer: the optimizer that applies the window (None: the record only
            accumulates).
        direct: the window is one micro-batch whose gradients are applied as they
            are (`steps=1`): what a variable received is known when the step is
            traced.
    """

    def __init__(self, accumulator, optimizer=None, direct=False):
        super().__init__(accumulator.state)
        self.accumulator = accumulator
        self.optimizer = optimizer
        self.direct = direct
        self.overwrites, self.measured = overwrite.kinds(accumulator.target_variables)

    # Primitives ---------------------------------------------------------------------

    def sums(self) -> list:
        return [acc.read_value() for acc in self.state.accumulators]

    def dtypes(self) -> list:
        return [v.dtype for v in self.accumulator.target_variables]

    def all_finite(self, gradients):
        if not self.has("noise_pieces_norm"):
            return finite.all_finite(gradients)
        # With the noise scale, its squared norm is the screen's pass too.
        verdict, squared = finite.finite_and_norm(gradients)
        self.screened(gradients, squared)
        return verdict

    def norm_of(self, gradients):
        return finite.squared_norm(gradients)

    def add_sums(self, gradients, factor, accept) -> None:
        layers = self.accumulator.batch_normalization_layers

        def add():
            _sums.add_micro_batch(self.state.accumulators, gradients, factor)
            for layer in layers:
                layer._accept_micro_batch()
            return tf.constant(True)

        def skip():
            for layer in layers:
                layer._discard_micro_batch()
            return tf.constant(False)

        with self._after_checks():
            if _static(accept) is True:
                add()
            else:
                tf.cond(accept, add, skip)

    def close(self, apply, close, update, finish, empty_sums=True):
        apply = tf.logical_and(tf.cast(apply, tf.bool), self.holds())

        def run():
            update()
            return tf.constant(True)

        def closing():
            applied = tf.cond(apply, run, lambda: tf.constant(False))
            with tf.control_dependencies([applied]):
                finish(applied)
                if empty_sums:
                    self.empty_sums()
            return tf.identity(applied)

        with self._after_checks():
            if _static(close) is True:
                return closing()
            # Most micro-batches close nothing: their branch is empty, and the
            # update's is not walked (`cond_kept_whole`).
            return cond_kept_whole(tf.cast(close, tf.bool), closing, lambda: tf.constant(False))

    def set_sums(self, values) -> None:
        with self._after_checks():
            for variable, value in zip(self.state.accumulators, values):
                if value is not None:
                    variable.assign(tf.cast(value, variable.dtype))

    def empty_sums(self) -> None:
        """The window's sums (and its batch normalization windows) emptied."""
        for variable in self.state.accumulators:
            variable.assign(tf.zeros_like(variable))
        for layer in self.accumulator.batch_normalization_layers:
            layer._reset_window()

    def apply(self, gradients, pooled=None) -> None:
        """One optimizer update with G; a variable the window gave no gradient to is
        left out of it (decided at run time, from `received`). `pooled`: each driven
        batch normalization layer's global window under several replicas."""
        accumulator = self.accumulator
        optimizer = self.optimizer
        if kc.is_loss_scale_optimizer(optimizer):
            # The accumulated gradients are unscaled and finite already.
            optimizer = optimizer.inner_optimizer
        targets = accumulator.target_variables
        pairs = [(g, v) for g, v in zip(gradients, targets) if g is not None]
        if self.direct:
            # One micro-batch: its missing gradients are known as the step traces.
            kc.apply_gradients(optimizer, pairs)
            return
        received = self.get("received") > 0

        def apply_all():
            kc.apply_gradients(optimizer, pairs)
            return tf.constant(True)

        def apply_received():
            index = {kc.var_key(optimizer, v): i for i, v in enumerate(targets)}
            # What Keras's optimizer does to a variable outside its update step (a
            # constraint, an overwrite with the gradient) is undone where the window
            # gave no gradient, as Keras leaves such a variable alone.
            kept = [
                (i, v, tf.identity(v))
                for i, v in enumerate(targets)
                if getattr(v, "constraint", None) is not None
                or getattr(v, "overwrite_with_gradient", False)
            ]
            with kc.updating_only(optimizer, lambda key: received[index[key]]):
                kc.apply_gradients(optimizer, pairs)
            for i, variable, value in kept:
                variable.assign(tf.where(received[i], variable, value))
            return tf.constant(True)

        tf.cond(tf.reduce_all(received), apply_all, apply_received)
        for i, layer in enumerate(accumulator.batch_normalization_layers):
            layer._commit_window(None if pooled is None else pooled[i])

    def fail(self, error, code: str, at, value=None) -> None:
        """Raises eagerly; in a traced step, an assertion the micro-batch's later
        writes wait for."""
        state = self.state
        if tf.executing_eagerly():
            if bool(error):
                message = messages.error_message(
                    code, int(state.micro_batches) + 1, int(at),
                    None if value is None else int(value),
                )
                if code == "schedule":
                    raise ValueError(message)
                raise tf.errors.InvalidArgumentError(None, None, message)
            return
        parts = error_parts(code, state.micro_batches + 1, at, value)
        self.checks.append(tf.debugging.Assert(tf.logical_not(error), parts, summarize=1))

    def noised(self, sums) -> list:
        if self.accumulator._privacy.value is None:
            return sums
        from gradaccum.backends.tensorflow import privacy

        return privacy.noised(self.accumulator, sums)

    def loss_scale(self):
        optimizer = self.accumulator._loss_scaling.value
        if optimizer is None:
            return None
        return (tf.convert_to_tensor(optimizer.step_counter),
                tf.convert_to_tensor(optimizer.dynamic_scale))

    def set_loss_scale(self, counter, scale) -> None:
        optimizer = self.accumulator._loss_scaling.value
        with self._after_checks():
            optimizer.step_counter.assign(tf.cast(counter, optimizer.step_counter.dtype))
            optimizer.dynamic_scale.assign(tf.cast(scale, optimizer.dynamic_scale.dtype))


def error_parts(code: str, micro_batch, at, value=None) -> list:
    """A graph assertion's message for an error of `code`: the words of
    `core.messages.error_message` around the tensors."""
    if code == "nonfinite":
        words = finite.RAISE_WORDS
        return [words[0], micro_batch, words[1], at, words[2]]
    if code == "negative_weight":
        around = messages.error_message("negative_weight", at="\x00").split("\x00")
        return [around[0], at, around[1]]
    return [f"{SCHEDULE_RULE} Received:", value, "for update_index=", at]


# Fields a window's close empties, in TensorFlow's record (its own names).
EMPTIED = RESET


class Runner(ScheduleRunner):
    """How the traced step runs a `steps` callable: wrapped in a `tf.function`
    (AutoGraph on), so Python `if`/`while` on the update index work as TensorFlow
    control flow; Python side effects happen when it is traced, not per call. Window
    lengths are int64, the accumulator's counters' dtype."""

    length_dtype = "int64"

    def prepare(self, steps):
        prepared = (steps if hasattr(steps, "get_concrete_function")
                    else tf.function(steps, autograph=True))
        # Tried now on a symbolic update index (the rule tries update 0 next).
        with tf.init_scope():
            try:
                prepared.get_concrete_function(tf.TensorSpec((), tf.int64))
            except tf.errors.OperatorNotAllowedInGraphError as error:
                raise ValueError(
                    "The `steps` callable must run in a traced step: written with "
                    "TensorFlow ops, or with Python control flow that AutoGraph can "
                    "convert (its source in a file or a notebook). Received: a "
                    f"callable that failed on a symbolic update index: {error}"
                ) from error
        return prepared

    def value(self, prepared, update_index):
        return prepared(tf.cast(update_index, tf.int64))

    def first(self, rule) -> int:
        with tf.init_scope():
            return int(rule.length(tf.constant(0, tf.int64)))
