"""What the fit integration says and restores the same way on every backend: the
warnings and errors of `fit`, and the restore of saved accumulation state."""

from __future__ import annotations

import warnings

import keras
import numpy as np

EMPTY_FIT = (
    "`fit` must receive at least one micro-batch. Received: data that yielded no batch "
    "(an empty dataset or array), so nothing was accumulated or applied."
)


def warn_inexact(stacklevel: int = 3) -> None:
    """Several loss terms whose normalizers are not proportional across a window."""
    warnings.warn(
        "weighting='exact' is approximate for this model: its loss terms have "
        "normalizers that are not proportional across the micro-batches of a "
        "window (e.g. outputs with their own masks), so one weight per "
        "micro-batch cannot reproduce the large-batch loss. Use equal "
        "micro-batches, or a `weighting` callable for your normalizer.",
        stacklevel=stacklevel,
    )


def warn_no_compiled_loss(stacklevel: int = 3) -> None:
    warnings.warn(
        "weighting='exact' found no compiled loss (only `add_loss` terms): "
        "micro-batches are weighted by their size.",
        stacklevel=stacklevel,
    )


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
            if np.any(value):
                warnings.warn(
                    f"gradaccum discards the saved accumulation state {key!r}: its "
                    f"shape {tuple(value.shape)} is not the variable's "
                    f"{tuple(variable.shape)} (the model's trainable variables "
                    "changed).",
                    stacklevel=3,
                )
            continue
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
    slots = {name: [] for name in vectors}
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


def begin_fit(accumulation, hook, epochs, callbacks, kwargs):
    """What both adapters do as `fit` starts: `hook` first among the callbacks (and
    told whether there are epochs to run), the train function made again when the
    fit's ability to restore inside an epoch changed (the step that skips restored
    micro-batches costs a branch per micro-batch: compiled only for fits that can
    restore), and the epoch position at its start (BackupAndRestore may then restore
    one inside an epoch). Returns the callbacks to give `fit`."""
    hook.epochs_to_run = epochs > kwargs.get("initial_epoch", 0)
    callbacks, resumable = hook_first(hook, callbacks)
    if resumable != accumulation.resumable:
        accumulation.resumable = resumable
        accumulation.host.train_function = None
    if accumulation.state is not None:
        accumulation.state.epoch_step.assign(0)
        accumulation.state.resume_skip.assign(0)
    return callbacks


def after_fit(accumulation, failed: bool = False) -> None:
    """When a fit ends, however it ends (an error, an interrupt): no epoch runs
    outside it, so windows close by their rule only (`train_on_batch`); the fit's
    epoch length would otherwise close one at every micro-batch past it.
    `failed`: the fit raised, and its error is the one to see (Keras's JAX trainer
    may have taken the variables' values into its step and not given them back)."""
    state = accumulation.state
    if state is None:
        return
    try:
        state.epoch_length.assign(-1)
        state.epoch_step.assign(0)
    except Exception:
        if not failed:
            raise


def hook_first(hook, callbacks):
    """`fit`'s callbacks with gradaccum's `hook` first, and whether they can restore
    inside an epoch (a `BackupAndRestore` among them).

    A caller's `CallbackList` is left as it is (the hook runs first, then the list,
    through `_Forward`); a plain list gets the hook in front.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        listed = callbacks.callbacks
        callbacks = keras.callbacks.CallbackList([hook, _Forward(callbacks)])
    else:
        callbacks = [hook, *(callbacks or [])]
        listed = callbacks
    resumable = any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in listed)
    return callbacks, resumable


class _Forward(keras.callbacks.Callback):
    """Passes every callback event on to a caller's `CallbackList`, untouched."""

    def __init__(self, callbacks):
        super().__init__()
        self._callbacks = callbacks

    def set_model(self, model):
        pass  # the caller's list keeps the model and params it was given

    def set_params(self, params):
        pass


for _event in [name for name in dir(keras.callbacks.Callback) if name.startswith("on_")]:
    setattr(
        _Forward,
        _event,
        lambda self, *args, _event=_event, **kwargs: getattr(self._callbacks, _event)(
            *args, **kwargs
        ),
    )


def size_chosen(accumulation) -> None:
    """`micro_batch_size="auto"` ran a batch: the host's `micro_batch_size` follows
    the search (`accumulation.auto_size`), which says once (when `fit` is verbose,
    `accumulation._verbose`) where it settled."""
    search = accumulation.auto_size
    accumulation.host.__dict__["micro_batch_size"] = search.chosen
    # Said when a size that ran out of memory decided it (and again if the search
    # later settles elsewhere); without a failure nothing is split.
    if (search.settled and search.fails is not None
            and accumulation._announced != search.chosen):
        accumulation._announced = search.chosen
        verbose = accumulation._verbose
        if verbose:
            failed = ", ".join(str(size) for size in search.failures)
            reason = f" ({failed} ran out of memory)" if failed else ""
            # On a line of its own, after the progress bar's.
            start = "\n" if verbose in (1, "auto") else ""
            print(
                f'{start}gradaccum: micro_batch_size="auto" settled on '
                f"{search.chosen} samples per micro-batch{reason}."
            )
