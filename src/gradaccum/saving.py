"""The accumulation state saved beside the weights, and restored.

A save writes every variable of the state under `PREFIX` and its stable name
(`gradaccum_<name>`: Keras's weights store for `wrap`'s model, the `.gradaccum.npz`
file beside `save_weights`' for `accumulate`). A load keeps the values waiting until
the state they belong to exists (`Accumulation.restore_pending`). A window's sums
wait keyed by their variable's path, so that a compile that changes the trainable
variables keeps each sum with its variable.
"""

from __future__ import annotations

import os
import warnings

import keras
import numpy as np

# The prefix of the state's entries in a weights store.
PREFIX = "gradaccum_"
# The file beside `save_weights`' that holds the window (`accumulate`).
SIDECAR = ".gradaccum.npz"
# The fit record's fields that describe the running epoch: not carried into the
# next fit by a compile.
EPOCH_FIELDS = ("epoch_step", "resume_skip", "epoch_length")


def loaded(store) -> dict:
    """What a save wrote of the state in `store`, by name (the running epoch's
    length, which a file saved before it was left out may hold, ignored)."""
    return {
        key[len(PREFIX):]: np.asarray(store[key])
        for key in store.keys()
        if key.startswith(PREFIX) and key != PREFIX + "epoch_length"
    }


def sidecar(filepath) -> str:
    """The file beside a weights file that holds the accumulation state (np.savez
    appends ".npz" to a name without it)."""
    return os.fspath(filepath) + SIDECAR


def storable(value) -> np.ndarray:
    """A state value as a file keeps it: a float NumPy has no dtype for (bfloat16,
    ml_dtypes' floats, which `np.savez` writes as raw bytes no load reads back) in
    float32, which holds it exactly; `restore` casts it back to the variable's."""
    value = np.asarray(value)
    if value.dtype.kind not in "biuf":
        value = value.astype("float32")
    return value


def restore(named: dict, pending: dict) -> None:
    """Assigns the saved values in `pending` (popped) to the variables of `named` of
    the same name; a value whose shape is no longer the variable's (the model's
    trainable variables changed since) is discarded, with a warning if it held
    anything: that window cannot go on."""
    for key, variable in named.items():
        if key not in pending:
            continue
        value = np.asarray(pending.pop(key))
        if tuple(value.shape) != tuple(variable.shape):
            # (The loss terms' ratios are a check, made again at the next window.)
            if np.any(value) and key not in ("term_ratios", "inexact", "unequal"):
                warnings.warn(
                    f"gradaccum discards the saved accumulation state {key!r}: its "
                    f"shape {tuple(value.shape)} is not the variable's "
                    f"{tuple(variable.shape)} (the model's trainable variables "
                    "changed).",
                    stacklevel=3,
                )
            continue
        if keras.backend.standardize_dtype(variable.dtype) == "bfloat16":
            # A bfloat16 state kept as float32 by `storable` (other dtypes assign as
            # they are: JAX without 64-bit mode keeps an int64 field as int32).
            value = keras.ops.convert_to_numpy(keras.ops.cast(value, "bfloat16"))
        variable.assign(value)


# An open window's sums wait for the next state under their variable's path: a compile
# after `layer.trainable = False` changes the list (and the order) of trainable
# variables, and a sum must stay with its variable.
_BY_PATH = "accumulator@"


def keyed_by_variable(values: dict, variables, prefix: str = "", vectors=()) -> dict:
    """`values` (saved by slot: `<prefix>accumulator_<i>`, and each name of `vectors`
    with one entry per variable) with the per-variable entries keyed by the paths of
    `variables` instead."""
    values = dict(values)
    vectors = {name: values.pop(prefix + name, None) for name in vectors}
    for i, variable in enumerate(variables):
        key = f"{prefix}{_BY_PATH}{variable.path}"
        values[key] = {"sum": values.pop(f"{prefix}accumulator_{i}", None)}
        for name, vector in vectors.items():
            if vector is not None:
                values[key][name] = np.asarray(vector)[i]
    return values


def to_slots(pending: dict, variables, prefix: str = "", vectors=()) -> None:
    """Puts what `keyed_by_variable` keyed by path back in the slots of `variables`
    (the new list), in place; a variable no longer among them loses its share of the
    open window, with a warning if it held anything."""
    start = prefix + _BY_PATH
    by_path = {k[len(start):]: k for k in pending if k.startswith(start)}
    if not by_path:
        return
    slots: dict[str, list] = {name: [] for name in vectors}
    for i, variable in enumerate(variables):
        saved = pending.pop(by_path.pop(variable.path, None), None) or {}
        if saved.get("sum") is not None:
            pending[f"{prefix}accumulator_{i}"] = saved["sum"]
        for name in vectors:
            slots[name].append(saved.get(name, 0))
    for name, entries in slots.items():
        pending[prefix + name] = np.asarray(entries)
    for path, key in by_path.items():
        saved = pending.pop(key)
        if saved.get("sum") is not None and np.any(saved["sum"]):
            warnings.warn(
                f"gradaccum discards the open window's gradient sum of {path!r}: it "
                "is no longer a trainable variable of the model.",
                stacklevel=3,
            )
