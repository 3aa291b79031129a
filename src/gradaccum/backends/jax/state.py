"""The accumulation state on JAX: one record, riding in the trainer's state."""

from __future__ import annotations

import keras


class AccumulationState(keras.metrics.Metric):
    """Every value gradaccum keeps between micro-batches on JAX, as the variables of
    a metric the model tracks: Keras's JAX trainer passes metric variables into its
    jitted step and back, syncs them to the model when a callback reads it, and
    never saves them in `model.save()` (the model's file stays Keras's own).

    It reports no result (`fit`'s logs get their entries from the step) and its
    `reset_state` keeps the window: Keras resets metrics at every epoch, and a
    window may stay open across epochs (`partial="carry"`).

    Fields (`FIELDS`, plus `accumulator_<i>` per trainable variable):
    - `total_weight`: the sum of the open window's micro-batch weights.
    - `micro_step`: micro-batches accumulated in the open window.
    - `window_skipped`: micro-batches of the open window skipped as not finite (they
      count towards its length).
    - `window_steps`: the open window's length, read from the schedule when it opened.
    - `skipped`: micro-batches skipped in all.
    - `updates`: windows applied (the position of a `steps` schedule).
    - `last_window_micro_batches`, `last_window_weight`: what the last update's
      window held.
    - `epoch_step`, `epoch_length`: micro-batches seen in the current epoch and its
      length (-1: unknown), for the window the data ends in.
    - `resume_skip`: micro-batches still to skip after a restore inside an epoch.
    - `term_ratios`, `inexact`: with several loss terms, their normalizer ratios at
      the window's start and whether a window had others (one weight is then not
      exact).
    - `micro_batches`: micro-batches presented since the state was made.
    - `error`, `error_at`, `error_micro_batch`: the first run-time error of the
      step (`ERRORS`), where it happened (the micro-batch's place in its window,
      counted from 1; the update index for a schedule's value below 1) and its
      number among all micro-batches (from 1); raised by `fit` after the jitted
      call, which cannot raise.
    """

    FIELDS = (
        "total_weight",
        "micro_step",
        "window_skipped",
        "window_steps",
        "skipped",
        "updates",
        "last_window_micro_batches",
        "last_window_weight",
        "epoch_step",
        "epoch_length",
        "resume_skip",
        "term_ratios",
        "inexact",
        "micro_batches",
        "error",
        "error_at",
        "error_micro_batch",
    )
    # What `error` holds.
    ERRORS = {"nonfinite": 1, "negative_weight": 2, "schedule": 3}

    def __init__(self, variables, accumulator_dtype="float32", terms=0):
        super().__init__(name="gradaccum_state")
        self.accumulators = [
            self.add_variable(
                shape=tuple(v.shape), initializer="zeros", dtype=accumulator_dtype,
                name=f"accumulator_{i}",
            )
            for i, v in enumerate(variables)
        ]
        weight_dtype = "float64" if accumulator_dtype == "float64" else "float32"
        for field in self.FIELDS:
            shape, dtype = (), "int32"
            if field in ("total_weight", "last_window_weight"):
                dtype = weight_dtype
            elif field == "term_ratios":
                shape, dtype = (terms,), "float32"
            elif field == "inexact":
                dtype = "bool"
            initializer = "zeros" if field != "epoch_length" else keras.initializers.Constant(-1)
            setattr(self, field, self.add_variable(
                shape=shape, initializer=initializer, dtype=dtype, name=field
            ))

    def named(self) -> dict:
        """Every variable under its stable name (`accumulator_<i>` and the fields)."""
        named = {f"accumulator_{i}": v for i, v in enumerate(self.accumulators)}
        named.update({field: getattr(self, field) for field in self.FIELDS})
        return named

    def update_state(self, *args, **kwargs):
        raise TypeError(
            "gradaccum's accumulation state is written by its training step only; it "
            "is not a metric to update."
        )

    def result(self):
        return {}

    def reset_state(self):
        pass
