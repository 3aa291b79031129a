"""The accumulation state on JAX: one record, riding in the trainer's state."""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np


class AccumulationState(keras.metrics.Metric):
    """Every value gradaccum keeps between micro-batches on JAX, as the variables of
    a metric the model tracks: Keras's JAX trainer passes metric variables into its
    jitted step and back, syncs them to the model when a callback reads it, and
    never saves them in `model.save()` (the model's file stays Keras's own).

    It reports no result (`fit`'s logs get their entries from the step) and its
    `reset_state` keeps the window: Keras resets metrics at every epoch, and a
    window may stay open across epochs (`partial="carry"`).

    Variables: `accumulator_<i>` per trainable variable (its window's sum; a scalar
    zero in split mode, where the sums never outlive a step), and the scalar fields
    packed into two vectors, `counts` (int32: the integer and boolean fields) and
    `weights` (the weight fields, then `term_ratios`). Every array the trainer
    carries costs each call of the step (JAX's dispatch, Keras's tracking of its
    state), so the fields travel as two; the step reads and writes them by name
    (`unpack` / `pack`), and `named()` gives each field as a variable-like view
    (`numpy`, `assign`, `shape`, `value`) under its own name, the name checkpoints
    keep.

    Fields (`FIELDS`):
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
    - with `gradaccum.Privacy`, `largest_window`: the most examples a window
      applied held (the accountant's sampling rate).
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
    # The fields kept in `weights` (the rest are in `counts`).
    WEIGHT_FIELDS = ("total_weight", "last_window_weight", "largest_window", "term_ratios")
    # What `error` holds.
    ERRORS = {"nonfinite": 1, "negative_weight": 2, "schedule": 3}

    def __init__(self, variables, accumulator_dtype="float32", terms=0, layouts=None,
                 split=False, private=False):
        super().__init__(name="gradaccum_state")
        self.fields = self.FIELDS + (("largest_window",) if private else ())
        # Under a keras.distribution each accumulator is laid out as its variable
        # (sharded like it, never whole on one device) and every field replicated.
        layouts = layouts or [None] * len(variables)
        # In split mode every batch closes its window: the sums live in the step
        # only, and the state keeps a scalar zero in their place.
        self.accumulators = [
            self._add(() if split else tuple(v.shape), "zeros", accumulator_dtype,
                      f"accumulator_{i}", replicated(()) if split else layout)
            for i, (v, layout) in enumerate(zip(variables, layouts))
        ]
        weight_dtype = "float64" if accumulator_dtype == "float64" else "float32"
        # Each field's place: (vector, start, shape, dtype).
        self.places = {}
        sizes = {"counts": 0, "weights": 0}
        for field in self.fields:
            vector = "weights" if field in self.WEIGHT_FIELDS else "counts"
            shape = (terms,) if field == "term_ratios" else ()
            dtype = {"term_ratios": "float32", "inexact": "bool"}.get(
                field, weight_dtype if vector == "weights" else "int32"
            )
            self.places[field] = (vector, sizes[vector], shape, dtype)
            sizes[vector] += terms if shape else 1
        initial = np.zeros((sizes["counts"],), "int32")
        initial[self.places["epoch_length"][1]] = -1
        self.counts = self._add((sizes["counts"],), keras.initializers.Constant(initial),
                                "int32", "counts", replicated((1,)))
        self.weights = self._add((sizes["weights"],), "zeros", weight_dtype, "weights",
                                 replicated((1,)))

    def _add(self, shape, initializer, dtype, name, layout):
        """A variable of the state, with `layout` (None: the distribution's, if any)."""
        if layout is None:
            return self.add_variable(shape=shape, initializer=initializer, dtype=dtype,
                                     name=name)
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer=keras.initializers.get(initializer), shape=shape, dtype=dtype,
                trainable=False, aggregation="sum", synchronization="on_read", name=name,
                layout=layout,
            )
        self._tracker.add_to_store("variables", variable)
        return variable

    def __getattr__(self, name):
        # A field by name (`state.micro_step.numpy()`): its view.
        places = self.__dict__.get("places")
        if places is not None and name in places:
            return Field(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def carried(self) -> dict:
        """The variables the trainer carries, by name: the accumulators, `counts`
        and `weights`."""
        named = {f"accumulator_{i}": v for i, v in enumerate(self.accumulators)}
        named.update(counts=self.counts, weights=self.weights)
        return named

    def span(self, field: str) -> slice:
        """Where `field` sits in its vector."""
        _, start, shape, _ = self.places[field]
        return slice(start, start + (shape[0] if shape else 1))

    def read(self, vectors: dict, field: str):
        """`field`'s value out of `vectors` (`counts` and `weights` by name), in its
        own shape and dtype."""
        vector, _, shape, dtype = self.places[field]
        value = vectors[vector][self.span(field)]
        return (value if shape else value[0]).astype(dtype)

    def unpack(self, carried: dict) -> dict:
        """`carried`'s values (as `carried()` names them) with the fields read out of
        `counts` and `weights`: the window by name, as the step works on it."""
        window = {k: v for k, v in carried.items() if k not in ("counts", "weights")}
        window.update({field: self.read(carried, field) for field in self.places})
        return window

    def pack(self, window: dict) -> dict:
        """The inverse of `unpack`: the fields of `window` back in the two vectors
        (each holds at least two fields)."""
        carried = {k: v for k, v in window.items() if k not in self.places}
        for vector, dtype in (("counts", "int32"), ("weights", self.weights.dtype)):
            carried[vector] = jnp.concatenate([
                jnp.reshape(window[field], (-1,)).astype(dtype)
                for field, place in self.places.items() if place[0] == vector
            ])
        return carried

    def named(self) -> dict:
        """Every accumulator and field under its stable name (`accumulator_<i>` and
        the fields: the names checkpoints keep), each field as a `Field` view."""
        named = {f"accumulator_{i}": v for i, v in enumerate(self.accumulators)}
        named.update({field: Field(self, field) for field in self.fields})
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


class Field:
    """One field of an `AccumulationState`, read from and written to its packed
    vector as a variable would be (outside the jitted step)."""

    def __init__(self, state: AccumulationState, name: str):
        self.state = state
        self.name = name
        self.vector, _, self.shape, self.dtype = state.places[name]

    @property
    def value(self):
        state = self.state
        return state.read({self.vector: getattr(state, self.vector).value}, self.name)

    def numpy(self):
        return np.asarray(self.value)

    def assign(self, value) -> None:
        variable = getattr(self.state, self.vector)
        packed = np.array(variable.numpy())
        packed[self.state.span(self.name)] = np.reshape(np.asarray(value), (-1,)).astype(
            packed.dtype
        )
        variable.assign(packed)


def replicated(shape):
    """A whole copy on every device of the distribution's mesh (None without one)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    return keras.distribution.TensorLayout([None] * len(shape), distribution.device_mesh)


def layouts_of(variables) -> list:
    """The layout of each variable's accumulator under the distribution: the
    variable's own, else the one the distribution gives its path; checked to fit it."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return [None] * len(variables)
    layouts = []
    for variable in variables:
        layout = getattr(variable, "_layout", None) or distribution.get_variable_layout(variable)
        check_layout(layout, variable)
        layouts.append(layout)
    return layouts


def check_layout(layout, variable) -> None:
    """A layout fits a variable: one mesh axis name (or None) per dimension, each
    sharded dimension divisible by the size of its axes."""
    axes = tuple(getattr(layout, "axes", ()))
    mesh = getattr(layout, "device_mesh", None)
    shape = tuple(variable.shape)
    fits = len(axes) == len(shape)
    if fits and mesh is not None:
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        for dim, axis in zip(shape, axes):
            names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
            parts = 1
            for name in names:
                parts *= sizes.get(name, 0)
            if parts == 0 or dim % parts:
                fits = False
    if not fits:
        raise ValueError(
            "The layout of a trainable variable must fit it for its accumulator to "
            "take that layout: one mesh axis name (or None) per dimension, each sharded "
            "dimension divisible by its axes' size. Received: layout "
            f"{axes} on mesh {dict(zip(mesh.axis_names, mesh.shape)) if mesh else None} "
            f"for variable {variable.path!r} of shape {shape}"
        )
