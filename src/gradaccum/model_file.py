"""The accumulation state inside a `.keras` file (`model.save` of an `accumulate`d
model, and so `keras.callbacks.ModelCheckpoint(save_weights_only=False)`), and
`gradaccum.load_model`, which brings it back.

The file is Keras's own archive with one more member, `WINDOW` (the state as the
`save_weights` state file holds it, with the model and window rule it belongs to).
Keras's `load_model` reads the members it knows and leaves that one: the file still
loads in plain Keras, without the window. A save goes to a temporary file beside the
target, renamed over it once the window is in: a kill leaves the previous file whole.
Where the window cannot go into the file (an unzipped save, the legacy `.h5` format, a
remote path, a file object), an open window is warned about at the save, with what
keeps it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from gradaccum import saving, state_file

if TYPE_CHECKING:  # pragma: no cover
    from gradaccum.adapter import Accumulation

# The archive member that holds the accumulation state.
WINDOW = "gradaccum.window.npz"
# Where a model `load_model` returned keeps the state until `accumulate` takes it.
SAVED = "_gradaccum_saved_window"


def save(model: keras.Model, accumulation: Accumulation, keras_save: Callable[[Any, bool], Any],
         filepath: Any, overwrite: bool, zipped: bool | None, kwargs: dict[str, Any],
         signature: dict) -> Any:
    """`model.save(filepath, overwrite, zipped, **kwargs)` with the accumulation state
    in the archive (`keras_save(path, overwrite)` is Keras's save to a path)."""
    store: dict[str, Any] = {}
    accumulation.save_to(store)
    if not _carried(filepath, zipped):
        result = keras_save(filepath, overwrite)
        _warn_open(accumulation, filepath)
        return result
    filepath = os.fspath(filepath)
    if not _write(keras_save, filepath, overwrite, state_file.stamped(store, signature)):
        return None
    micro_batches = accumulation.open_micro_batches()
    if micro_batches and "model_file" not in accumulation._warned:
        accumulation._warned.add("model_file")
        warnings.warn(
            f"gradaccum wrote the open window ({micro_batches} micro-batches) into "
            f"{filepath!r}. keras.saving.load_model leaves it out: load the file with "
            "gradaccum.load_model, then gradaccum.accumulate, to resume it exactly.",
            stacklevel=3,
        )
    return None


def _carried(filepath: Any, zipped: bool | None) -> bool:
    """Whether a save to `filepath` can hold the window: a local zipped `.keras`."""
    return (isinstance(filepath, (str, os.PathLike))
            and os.fspath(filepath).endswith(".keras")
            and "://" not in os.fspath(filepath) and zipped in (None, True))


def _write(keras_save: Callable[[Any, bool], Any], filepath: str, overwrite: bool,
           entries: dict[str, Any]) -> bool:
    """Keras's file at `filepath` with `entries` (a state's, stamped) as the
    `WINDOW` member, written atomically; False where the user declined to
    overwrite."""
    if not state_file.keras_save(filepath, overwrite, (), {})[0]:
        return False

    def add_window(written: str) -> None:
        content = io.BytesIO()
        np.savez(content, **entries)
        with zipfile.ZipFile(written, "a") as archive:
            archive.writestr(WINDOW, content.getvalue())
        with open(written, "rb+") as f:
            os.fsync(f.fileno())

    state_file.save_atomically(lambda path: keras_save(path, True), filepath,
                               before_rename=add_window, suffix=".keras")
    return True


def _warn_open(accumulation: Accumulation, filepath: Any, stacklevel: int = 3) -> None:
    """Warns that a save which cannot carry the state leaves an open window out."""
    micro_batches = accumulation.open_micro_batches()
    if micro_batches:
        into = "this file" if filepath is None else repr(filepath)
        warnings.warn(
            f"gradaccum cannot write the open window ({micro_batches} micro-batches) "
            f"into {into}: only model.save to a local zipped `.keras` file carries "
            "it. Save with model.save to a `.keras` path (then load it with "
            "gradaccum.load_model), or use model.save_weights, which writes the "
            "window beside the weights; else the window's micro-batches are lost at "
            "a load.",
            stacklevel=stacklevel,
        )


@contextlib.contextmanager
def carrying(accumulation: Accumulation) -> Iterator[None]:
    """The block saves the window itself (`model.save`, `save_weights`): Keras's
    store of the model's own variables says nothing then."""
    accumulation.saving_window = True
    try:
        yield
    finally:
        accumulation.saving_window = False


def storing(accumulation: Accumulation) -> None:
    """Keras writes the model's own variables to a file (its `save_own_variables`):
    outside `carrying` (`keras.saving.save_model`, a save of an outer model), an open
    window is warned about."""
    if not accumulation.saving_window:
        _warn_open(accumulation, None, stacklevel=4)


def load_model(filepath: str | os.PathLike[str], custom_objects: dict[str, Any] | None = None,
               compile: bool = True, safe_mode: bool = True) -> keras.Model:
    """Loads a `.keras` file as `keras.saving.load_model` does, with the accumulation
    state an `accumulate`d model's `save` wrote into it: the next
    `gradaccum.accumulate` on the returned model resumes the saved window exactly
    (its micro-batches, counters and schedule position). A file saved without
    gradaccum loads as Keras loads it.

    Args:
        filepath: the `.keras` file (a path).
        custom_objects, compile, safe_mode: as `keras.saving.load_model` takes them.

    Returns:
        The model, of its own class (not yet accumulating).

    Raises:
        ValueError: what Keras raises; the saved state cannot be read (a damaged
            file: the message says how to load without it). `accumulate` raises
            where the saved open window belongs to another model or window rule.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model = gradaccum.accumulate(model, steps=4, partial="carry")
        >>> model.compile(keras.optimizers.SGD(0.1), "mse")
        >>> _ = model.fit(np.ones((12, 3)), np.zeros((12, 1)), batch_size=2, verbose=0)
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
        >>> model.save(path)  # 6 micro-batches: 2 stay open
        >>> loaded = gradaccum.load_model(path)
        >>> loaded = gradaccum.accumulate(loaded, steps=4, partial="carry")
        >>> gradaccum.end_of_data(loaded)  # the window's 2 micro-batches came back
        2
    """
    model = keras.saving.load_model(filepath, custom_objects=custom_objects,
                                    compile=compile, safe_mode=safe_mode)
    saved = read(filepath)
    if saved is not None:
        model.__dict__[SAVED] = (os.fspath(filepath), saved)
        _keep_on_save(model, saved)
        if state_file._open_window(saved):
            _warn_on_plain_fit(model, os.fspath(filepath))
    return model


def _warn_on_plain_fit(model: keras.Model, filepath: str) -> None:
    """Until `accumulate` takes the saved open window (its own `fit` replaces this
    one), a `fit` warns that it trains without it."""
    cls = type(model)

    def fit(*args: Any, **kwargs: Any) -> Any:
        if SAVED in model.__dict__:
            warnings.warn(
                f"This model holds the open window gradaccum.load_model read from "
                f"{filepath!r}, and `fit` without gradaccum.accumulate trains without "
                "it (an update per batch; the window's micro-batches are lost). Call "
                "gradaccum.accumulate(model, ...) with the window rule that saved it "
                "first.",
                stacklevel=2,
            )
            model.__dict__.pop(SAVED, None)
        return cls.fit(model, *args, **kwargs)

    model.__dict__["fit"] = fit


def _keep_on_save(model: keras.Model, saved: dict[str, Any]) -> None:
    """Until `accumulate` takes the saved state, the model's `save` writes it again
    (a loaded model saved before it trains keeps its window)."""
    cls = type(model)
    entries = {state_file._FORMAT: np.asarray(state_file.format_of(saved)), **saved}

    def save(filepath: Any, overwrite: bool = True, zipped: bool | None = None,
             **kwargs: Any) -> Any:
        def keras_save(path: Any, overwrite: bool) -> Any:
            return cls.save(model, path, overwrite=overwrite, zipped=zipped, **kwargs)

        if _carried(filepath, zipped):
            _write(keras_save, os.fspath(filepath), overwrite, entries)
            return None
        result = keras_save(filepath, overwrite)
        if state_file._open_window(saved):
            warnings.warn(
                f"gradaccum cannot write the open window gradaccum.load_model read "
                f"into {filepath!r}: only model.save to a local zipped `.keras` file "
                "carries it; else the window's micro-batches are lost at a load.",
                stacklevel=2,
            )
        return result

    model.__dict__["save"] = save


def read(filepath: str | os.PathLike[str]) -> dict | None:
    """The state in a `.keras` file (None: the file has none)."""
    filepath = os.fspath(filepath)
    try:
        with zipfile.ZipFile(filepath, "r") as archive:
            if WINDOW not in archive.namelist():
                return None
            content = archive.read(WINDOW)
        with np.load(io.BytesIO(content), allow_pickle=False) as store:
            values = {key: store[key] for key in store.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise ValueError(
            f"The accumulation state in {filepath} ({WINDOW}) cannot be read "
            f"({error}): the file is damaged. Load it with keras.saving.load_model "
            "to resume with an empty window (the open window's micro-batches are "
            "lost)."
        ) from None
    version = values.pop(state_file._FORMAT, None)
    if version is None or int(version) not in state_file.READS:
        raise ValueError(
            f"The accumulation state in {filepath} has format {version}; this "
            f"gradaccum reads {state_file.READS_TEXT}. Load it with the gradaccum "
            "that saved it; or with keras.saving.load_model to resume with an empty "
            "window (the open window's micro-batches are lost)."
        )
    return values


def take(model: keras.Model, accumulation: Accumulation, signature: dict) -> None:
    """Gives `accumulation` the state `load_model` left on `model` (once): the
    running epoch's position stays behind (a new fit starts a new epoch)."""
    found = model.__dict__.pop(SAVED, None)
    if found is None:
        return
    # (`accumulate` has installed its own `save`, which writes the state it takes.)
    filepath, values = found
    values = dict(values)
    values, saved = state_file.reordered(
        values, json.loads(str(values.pop(state_file._SIGNATURE))), signature)
    mismatch = state_file._mismatch(saved, signature)
    if mismatch and state_file._open_window(values):
        raise ValueError(
            f"The accumulation state in {filepath} was saved for another {mismatch}, "
            "so its open window cannot go on in this one. Accumulate with the window "
            "rule that saved it; or load the file with keras.saving.load_model to "
            "resume with an empty window (the open window's micro-batches are lost)."
        )
    for field in saving.EPOCH_FIELDS:
        values.pop(saving.PREFIX + field, None)
    accumulation.load_from(values)
