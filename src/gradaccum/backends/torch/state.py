"""Where the state lives on PyTorch: `keras.Variable`s (torch tensors), written in
place.

Keras's torch trainer runs the step eagerly (or under `torch.compile`, where it
graph-breaks at gradaccum's decisions), so the state is plain variables the step
reads and writes, as on TensorFlow; nothing rides in a trainer's carry. The
fields and their names are `gradaccum.core.state`'s (`WINDOW` per optimizer's
record, `FIT` once); the per-variable sums are `accumulator_<i>`.
"""

from __future__ import annotations

import keras
import numpy as np

from gradaccum.core.state import FIT, NOISE, WINDOW, accumulator_name

# The name of a process's shard of the sums under `sums="sharded"`.
SHARD = "accumulator_shard"


def window_prefix(index: int) -> str:
    """The prefix of window record `index`'s field names ("" for the first)."""
    return "" if index == 0 else f"window_{index}_"


def _initial(field, weight_dtype: str, size: int):
    """A field's initial value (`core.state.Field`)."""
    if field.kind == "count":
        return np.asarray(field.initial, "int64")
    if field.kind == "weight":
        return np.asarray(field.initial, weight_dtype)
    if field.kind == "flag":
        return np.asarray(bool(field.initial))
    if field.kind == "ratios":
        return np.zeros([size], "float32")
    return np.zeros([size], weight_dtype)  # per_variable


def _variable(value, name: str) -> keras.Variable:
    return keras.Variable(value, dtype=str(value.dtype), trainable=False, name=name)


class TorchState:
    """Every value gradaccum keeps between micro-batches on PyTorch.

    Args:
        variables: the variables whose gradients are summed (one sum each).
        accumulator_dtype: the sums' dtype.
        records: window records (one per optimizer a model's own step may apply).
        terms: loss terms beyond the first whose normalizer ratios are tracked.
        private: whether `gradaccum.Privacy` trains (`largest_window` kept).
        statistics: `(name, channels)` of the followed batch normalization layers'
            window statistics.
        fit: whether the fit record is kept (False: a custom loop's accumulator).
        noise: whether each window record keeps the noise scale's fields.
    """

    def __init__(self, variables, accumulator_dtype="float32", *, records=1, terms=0,
                 private=False, statistics=(), fit=True, name="gradaccum",
                 shard_size=None, noise=False):
        self.records = records
        weight_dtype = "float64" if accumulator_dtype == "float64" else "float32"
        self.weight_dtype = weight_dtype
        named = {}
        with keras.name_scope(name):
            if shard_size is not None:
                # `sums="sharded"`: this process's shard of all the sums, flattened
                # (`distributed.ShardedSums`).
                named[SHARD] = _variable(np.zeros([shard_size], accumulator_dtype), SHARD)
            else:
                for i, v in enumerate(variables):
                    named[accumulator_name(i)] = _variable(
                        np.zeros(tuple(v.shape), accumulator_dtype), accumulator_name(i))
            for j in range(records):
                prefix = window_prefix(j)
                for field in WINDOW + (NOISE if noise else ()):
                    named[prefix + field.name] = _variable(
                        _initial(field, weight_dtype, len(variables)), prefix + field.name)
            if fit:
                for field in FIT:
                    if field.name == "largest_window" and not private:
                        continue
                    named[field.name] = _variable(
                        _initial(field, "float32", terms), field.name)
                for stat, channels in statistics:
                    named[stat] = _variable(np.zeros([channels], "float32"), stat)
        self.variables = named
        self.accumulators = ([named[SHARD]] if shard_size is not None else
                             [named[accumulator_name(i)] for i in range(len(variables))])

    def named(self) -> dict:
        """Every variable under its stable name."""
        return dict(self.variables)

    def __getattr__(self, name):
        variables = self.__dict__.get("variables", {})
        if name in variables:
            return variables[name]
        raise AttributeError(name)
