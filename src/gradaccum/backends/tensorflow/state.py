"""The saved state, declared once: the accumulator's record and fit's.

`AccumulatorState` is the one record of what a `GradientAccumulator` keeps between
micro-batches: TensorFlow variables with stable names, saved by
`tf.train.Checkpoint` (as attributes of this module) and by the fit integration
(through `named()`), so both read the same declaration.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from gradaccum.backends.tensorflow.distributed import COUNTED, SUMMED
from gradaccum.core.state import NOISE
from gradaccum.core.validation import variable_name

NOISE_NAMES = tuple(field.name for field in NOISE)


class Untracked:
    """Holds objects without making them checkpoint dependencies of a module.

    The accumulator refers to the model's variables but does not own them: a
    checkpoint of the accumulator saves the accumulation state only.
    """

    def __init__(self, value):
        self.value = value


class AccumulatorState(tf.Module):
    """The state of a gradient accumulator.

    Fields (variables; replica-local under tf.distribute, summed or first-replica
    when read or saved):

    - `accumulators`: one per target variable, the window's weighted gradient sum.
    - `received`: per target variable, how many micro-batches of the open window
      gave it a gradient. A variable with none is left out of the update, as Keras
      leaves out a `None` gradient; decided when the window closes, at run time.
    - `total_weight`: the sum of the window's micro-batch weights.
    - `micro_step`: micro-batches accumulated in the open window.
    - `window_skipped`: micro-batches of the open window skipped as not finite (they
      count towards its length).
    - `skipped`: micro-batches skipped in all.
    - `micro_batches`: micro-batches presented since creation, skipped ones included.
    - `updates`: updates made (the position of a `steps` schedule).
    - `window_steps`: the open window's length under a `steps` schedule, read when
      the window opened.
    - `last_window_micro_batches`, `last_window_weight`: what the last update's
      window held (micro-batches, skipped ones included; total weight, summed
      across replicas).
    """

    FIELDS = (
        "received",
        "total_weight",
        "micro_step",
        "window_skipped",
        "skipped",
        "micro_batches",
        "updates",
        "window_steps",
        "last_window_micro_batches",
        "last_window_weight",
    )

    def __init__(self, variables, accumulator_dtype, strategy=None, name="state",
                 noise=False):
        super().__init__(name=name)
        # With the noise scale, its fields (`core.state.NOISE`) after the others.
        self.fields = self.FIELDS + (NOISE_NAMES if noise else ())
        weight_dtype = tf.float64 if accumulator_dtype == tf.float64 else tf.float32
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            self.accumulators = [
                tf.Variable(
                    tf.zeros(v.shape, accumulator_dtype),
                    name=f"accumulator/{variable_name(v)}",
                    **SUMMED,
                )
                for v in variables
            ]
            # Of the weights' dtype: it travels in the same reduction as the weights.
            self.received = tf.Variable(
                tf.zeros([len(self.accumulators)], weight_dtype), name="received", **SUMMED
            )
            self.total_weight = tf.Variable(
                tf.constant(0, weight_dtype), name="total_weight", **SUMMED
            )
            int64 = dict(COUNTED, dtype=tf.int64)
            self.micro_step = tf.Variable(0, name="micro_step", **int64)
            self.window_skipped = tf.Variable(0, name="window_skipped", **int64)
            self.skipped = tf.Variable(0, name="skipped", **int64)
            self.micro_batches = tf.Variable(0, name="micro_batches", **int64)
            self.updates = tf.Variable(0, name="updates", **int64)
            self.window_steps = tf.Variable(0, name="window_steps", **int64)
            self.last_window_micro_batches = tf.Variable(
                0, name="last_window_micro_batches", **int64
            )
            self.last_window_weight = tf.Variable(
                tf.constant(0, weight_dtype), name="last_window_weight", **COUNTED
            )
            if noise:
                # The open window's pieces are each replica's (summed when read);
                # the readings' sums are written once per window, alike everywhere.
                for field in NOISE:
                    kind = SUMMED if field.reset else COUNTED
                    # (The open window's count in the weights' float: it travels
                    # in the window's one reduction with them.)
                    dtype = (tf.int64 if field.kind == "count" and not field.reset
                             else weight_dtype)
                    setattr(self, field.name, tf.Variable(
                        tf.zeros([], dtype), name=field.name, **kind))

    def named(self) -> dict[str, tf.Variable]:
        """Every variable under its stable name (`accumulator_<i>` and the fields)."""
        named = {f"accumulator_{i}": v for i, v in enumerate(self.accumulators)}
        named.update({field: getattr(self, field) for field in self.fields})
        return named


class FitState(tf.Module):
    """The accumulation state of `fit`: the accumulators and the epoch position.

    Args:
        accumulator: the exact step's `GradientAccumulator` (None for a model's own
            train_step, whose accumulators are made as its step hands gradients over).
        terms: the compiled loss's terms beyond the first (their normalizer ratios
            are tracked).
        private: whether `gradaccum.Privacy` trains (the largest window is kept).
        statistics: `(name, channels)` of the followed batch normalization layers'
            window statistics.
    """

    def __init__(self, accumulator=None, terms=0, private=False, statistics=()):
        super().__init__(name="gradaccum_fit_state")
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
        # With float8 layers: whether a window's micro-batches weighed differently.
        self.unequal = tf.Variable(False, name="unequal", **COUNTED)
        # Whether train_on_batch calls left the open window (the next fit closes it).
        self.outside_fit = tf.Variable(False, name="outside_fit", **COUNTED)
        # Split mode: the micro-batch size the step uses ("auto" changes it between
        # calls without a retrace), and whether the step got as far as applying
        # (a step that failed after that point cannot be retried).
        self.micro_batch_size = tf.Variable(1, name="micro_batch_size", **int64)
        self.applying = tf.Variable(False, name="applying", **COUNTED)
        # With `gradaccum.Privacy`: the most examples a window applied held (the
        # accountant's sampling rate).
        self.largest_window = (
            tf.Variable(0.0, name="largest_window", **COUNTED) if private else None
        )
        # The followed BatchNormalization layers' window statistics
        # (`core.moving_statistics`), per channel: `(name, channels)` given.
        self.statistics = {
            name: tf.Variable(tf.zeros([channels], tf.float32), name=name, **COUNTED)
            for name, channels in statistics
        }

    def accumulators(self) -> list:
        """Every accumulator: the exact step's, then a model's own step's."""
        return ([] if self.accumulator is None else [self.accumulator]) + [
            acc for acc, _ in self.own
        ]

    def saved_variables(self) -> dict[str, tf.Variable]:
        """What a saved model keeps of the state, under stable names."""
        named = {} if self.accumulator is None else self.accumulator.state_variables()
        for j, (acc, _) in enumerate(self.own):
            named.update({f"own_{j}_{k}": v for k, v in acc.state_variables().items()})
        named.update(epoch_step=self.epoch_step, resume_skip=self.resume_skip,
                     outside_fit=self.outside_fit)
        if self.largest_window is not None:
            named["largest_window"] = self.largest_window
        named.update(self.statistics)
        return named
