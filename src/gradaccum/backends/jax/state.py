"""The accumulation state on JAX: the records `gradaccum.core.state` declares, riding
in the trainer's state."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import keras
import numpy as np

from gradaccum.core.state import ERRORS, FIT, WINDOW, accumulator_name, fields
from gradaccum.core.state import Field as StateField


class Packed:
    """Accumulators and scalar fields as a backend's arrays: `accumulator_<i>` per
    variable, and the fields packed into two vectors, `counts` (int32: the integer
    and boolean fields) and `weights` (the weight fields and `term_ratios`). Every
    array a jitted step carries costs each call (JAX's dispatch, Keras's tracking of
    its state), so the fields travel as two; the step reads and writes them by name
    (`unpack` / `pack`), and `named()` gives each field as a variable-like view
    (`numpy`, `assign`, `shape`, `value`) under its own name, the name checkpoints
    keep.

    Args:
        declared: `(name, core.state.Field)` per field, in order.
        terms: the length of a `ratios` field.
        weight_dtype: the dtype of the weight fields.
    """

    # Set by the subclass: the sums (`accumulator_<i>`) and the two packed vectors.
    accumulators: list
    counts: Any
    weights: Any
    # The sums kept per device (`device_sums.DeviceRows`; None: whole, on each
    # device alike) and whether the state keeps split mode's scalar sums.
    rows: Any = None
    split: bool = False
    # Set by `layout`: the fields in order, and each one's place.
    fields: tuple[str, ...]
    places: dict[str, tuple[str, int, tuple[int, ...], str]]

    def layout(self, declared: list[tuple[str, StateField]], terms: int, weight_dtype: str,
               variables: int = 0, channels: dict[str, int] | None = None) -> dict:
        """Sets each field's place `(vector, start, shape, dtype)` and returns each
        vector's initial values (`terms`: a `ratios` field's length; `variables`: a
        `per_variable` field's; `channels`: a `per_channel` field's, by name)."""
        channels = channels or {}
        self.fields = tuple(name for name, _ in declared)
        self.places = {}
        initial: dict[str, list] = {"counts": [], "weights": []}
        for name, field in declared:
            vector = ("weights" if field.kind in ("weight", "ratios", "per_variable",
                                                  "per_channel")
                      else "counts")
            shape = {"ratios": (terms,), "per_variable": (variables,),
                     "per_channel": (channels.get(name, 0),)}.get(field.kind, ())
            dtype = {"ratios": "float32", "flag": "bool", "weight": weight_dtype,
                     "per_variable": weight_dtype,
                     "per_channel": "float32"}.get(field.kind, "int32")
            self.places[name] = (vector, len(initial[vector]), shape, dtype)
            initial[vector] += [field.initial] * (shape[0] if shape else 1)
        return initial

    def __getattr__(self, name: str) -> Field:
        # A field by name (`state.micro_step.numpy()`): its view.
        places = self.__dict__.get("places")
        if places is not None and name in places:
            return Field(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def carried(self) -> dict:
        """The variables a step carries, by name: the accumulators, `counts` and
        `weights`."""
        named = {accumulator_name(i): v for i, v in enumerate(self.accumulators)}
        named.update(counts=self.counts, weights=self.weights)
        return named

    def span(self, field: str) -> slice:
        """Where `field` sits in its vector."""
        _, start, shape, _ = self.places[field]
        return slice(start, start + (shape[0] if shape else 1))

    def read(self, vectors: dict, field: str) -> Any:
        """`field`'s value out of `vectors` (`counts` and `weights` by name), in its
        own shape and dtype."""
        vector, _, shape, dtype = self.places[field]
        value = vectors[vector][self.span(field)]
        return (value if shape else value[0]).astype(dtype)

    def unpack(self, carried: dict) -> dict:
        """`carried`'s values (as `carried()` names them) with the fields read out of
        `counts` and `weights`: the state by name, as the step works on it."""
        window = {k: v for k, v in carried.items() if k not in ("counts", "weights")}
        window.update({field: self.read(carried, field) for field in self.places})
        return window

    def pack(self, window: dict) -> dict:
        """The inverse of `unpack`: the fields of `window` back in the two vectors."""
        carried = {k: v for k, v in window.items() if k not in self.places}
        for vector, dtype in (("counts", "int32"), ("weights", self.weights.dtype)):
            parts = [jnp.reshape(window[field], (-1,)).astype(dtype)
                     for field, place in self.places.items() if place[0] == vector]
            carried[vector] = jnp.concatenate(parts) if parts else jnp.zeros((0,), dtype)
        return carried

    def named(self) -> dict:
        """Every accumulator and field under its stable name (`accumulator_<i>` and
        the fields: the names checkpoints keep), each field as a `Field` view, and
        sums kept per device as one whole sum (`device_sums.SumView`)."""
        named = {accumulator_name(i): v for i, v in enumerate(self.accumulators)}
        if self.rows is not None and not self.split:
            from gradaccum.backends.jax.device_sums import SumView

            rows = self.rows
            named = {name: SumView(v, rows.dims[i] is None, rows.mesh)
                     for i, (name, v) in enumerate(named.items())}
        named.update({field: Field(self, field) for field in self.fields})
        return named


class AccumulationState(Packed, keras.metrics.Metric):
    """Every value gradaccum keeps between micro-batches of `fit` on JAX, as the
    variables of a metric the model tracks: Keras's JAX trainer passes metric
    variables into its jitted step and back, syncs them to the model when a callback
    reads it, and never saves them in `model.save()` (the model's file stays Keras's
    own).

    It reports no result (`fit`'s logs get their entries from the step) and its
    `reset_state` keeps the window: Keras resets metrics at every epoch, and a
    window may stay open across epochs (`partial="carry"`).

    It holds the records `gradaccum.core.state` declares: the fit record, and one
    window record per optimizer the model holds (`records`: Keras's default step
    uses the first, `model.optimizer`'s; a model's own step one per optimizer it
    hands gradients to), the first under the fields' own names, record `j` under
    `window_<j>_<field>`; packed as `Packed` says (a scalar zero in place of each
    sum in split mode, where the sums never outlive a step).
    """

    # What `error` holds.
    ERRORS = ERRORS

    def __init__(self, variables, accumulator_dtype="float32", terms=0, layouts=None,
                 split=False, private=False, records=1, statistics=(), rows=None,
                 noise=False):
        keras.metrics.Metric.__init__(self, name="gradaccum_state")
        self.records = records
        # Under a keras.distribution's batch axis of N devices, the sums kept per
        # device (`device_sums.DeviceRows`), or None; in split mode the step's own
        # (the state keeps a scalar per sum).
        self.rows = rows
        self.split = split
        fit = fields(FIT, without=() if private else ("largest_window",))
        # A gradient is never missing at run time on JAX: no `received` counts.
        window = fields(WINDOW, without=("received",), noise=noise)
        declared = [(field.name, field) for field in fit]
        for j in range(records):
            declared += [(window_prefix(j) + field.name, field) for field in window]
        # The followed BatchNormalization layers' window statistics
        # (`core.moving_statistics`): `(name, channels)` given.
        declared += [(name, StateField(name, "per_channel")) for name, _ in statistics]
        channels = dict(statistics)
        # Under a keras.distribution each accumulator is laid out as its variable
        # (sharded like it, never whole on one device) and every field replicated.
        # With rows, an accumulator holds one row per device of the batch axis,
        # each device its own; or sharded over it (`sums="sharded"`).
        layouts = layouts or [None] * len(variables)
        self.accumulators = []
        for i, (v, layout) in enumerate(zip(variables, layouts)):
            shape = tuple(v.shape)
            if split:
                shape, layout = (), replicated(())
            elif rows is not None:
                shape, layout = rows.shape(i, shape), rows.layout(i, shape)
            self.accumulators.append(self._add(shape, "zeros", accumulator_dtype,
                                               accumulator_name(i), layout))
        weight_dtype = "float64" if accumulator_dtype == "float64" else "float32"
        initial = self.layout(declared, terms, weight_dtype, channels=channels)
        self.counts = self._add(
            (len(initial["counts"]),),
            keras.initializers.Constant(np.asarray(initial["counts"], "int32")),
            "int32", "counts", replicated((1,)),
        )
        self.weights = self._add((len(initial["weights"]),), "zeros", weight_dtype,
                                 "weights", replicated((1,)))

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

    def update_state(self, *args, **kwargs):
        raise TypeError(
            "gradaccum's accumulation state is written by its training step only; it "
            "is not a metric to update."
        )

    def result(self):
        return {}

    def reset_state(self):
        pass


def window_prefix(index: int) -> str:
    """The prefix of window record `index`'s field names ("" for the first)."""
    return "" if index == 0 else f"window_{index}_"


class Field:
    """One field of an `AccumulationState`, read from and written to its packed
    vector as a variable would be (outside the jitted step)."""

    def __init__(self, state: Packed, name: str) -> None:
        self.state = state
        self.name = name
        self.vector, _, self.shape, self.dtype = state.places[name]

    @property
    def value(self) -> Any:
        state = self.state
        return state.read({self.vector: getattr(state, self.vector).value}, self.name)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def assign(self, value: Any) -> None:
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
