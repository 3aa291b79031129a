"""The accumulation state file beside `save_weights`' file (`accumulate`'s models),
written so that the weights and the window state on disk are always one consistent
pair, whatever a save is killed at.

A save (`save`):

1. writes the weights to a temporary file beside the target (`.weights.h5`: the
   weights are then replaced in one rename);
2. writes the state file to a temporary name, holding the new state tied to the new
   weights (the SHA-256 of their file) and the state of the save before it tied to
   the weights still on disk, then renames it over the old one;
3. renames the new weights over the old ones.

Killed before 2's rename, the disk holds the previous pair; between the two renames,
the previous weights and a state file whose previous entry belongs to them; after 3,
the new pair. A load (`load`) takes the entry whose weights digest is the file's: so
`BackupAndRestore(double_checkpoint=True)`, which copies the last weights to its
backup before each save and falls back to that copy when the main file is
unreadable, gets the window saved with the backup.

A state file that cannot be read, that belongs to no weights beside it, or that was
written for another model, another window rule or another format is an error that
names the file and the way out, never an empty or a wrong window.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
import zipfile

import numpy as np

from gradaccum import _keras_common as kc
from gradaccum import saving

# The formats this gradaccum writes and reads: 2, the weights and the window state
# saved as one pair; 3, the same with a window `train_on_batch` calls left open
# (`outside_fit`: the next `fit` closes it), which a reader of format 2 alone would
# carry on instead, so it refuses the file.
FORMAT = 2
FORMAT_OUTSIDE_FIT = 3
READS = (FORMAT, FORMAT_OUTSIDE_FIT)
READS_TEXT = "formats 2 and 3"
# The keys of the state file besides the state's own (`saving.PREFIX`).
_FORMAT = "gradaccum@format"
_SIGNATURE = "gradaccum@signature"
_WEIGHTS = "gradaccum@weights"
_PREVIOUS = "previous@"

_SUFFIX = ".weights.h5"


def digest(filepath) -> str:
    """The SHA-256 of a weights file (a sharded save's `.weights.json` and every
    shard it lists)."""
    paths = [os.fspath(filepath)]
    if paths[0].endswith(".weights.json"):
        with open(paths[0]) as f:
            listed = json.load(f)
        shards = sorted({name for name in _shard_names(listed)})
        folder = os.path.dirname(paths[0])
        paths += [os.path.join(folder, name) for name in shards]
    hasher = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                hasher.update(chunk)
    return hasher.hexdigest()


def _shard_names(listed) -> list:
    """The shard files a sharded save's `.weights.json` names (its `weight_map`
    lists them, as strings or lists of strings)."""
    if isinstance(listed, str):
        return [listed] if listed.endswith(_SUFFIX) else []
    values = listed.values() if isinstance(listed, dict) else listed
    if not isinstance(values, (list, tuple, type({}.values()))):
        return []
    names = []
    for value in values:
        names += _shard_names(value)
    return names


def save(save_weights, filepath, state: dict, signature: dict, sharded=False) -> None:
    """Saves the weights with `save_weights(path)` (Keras's, to the path given) and
    `state` (the accumulation state's entries, `saving.PREFIX` names) beside them
    as one consistent pair: see the module's docstring. `signature` says which
    model and window rule the state is for. A `sharded` save (Keras's
    `max_shard_size`) is written in place, its state tied to the `.weights.json`
    and its shards."""
    filepath = _resolved(filepath)
    written_as = filepath
    if sharded and filepath.endswith(_SUFFIX):
        # Keras writes a sharded save to the `.weights.json` of the name.
        filepath = filepath[:-len(".h5")] + ".json"
    path = saving.sidecar(filepath)
    # The entry of the save before this one, kept while its weights are on disk.
    previous = {}
    if os.path.exists(filepath) and os.path.exists(path):
        try:
            on_disk = digest(filepath)
            previous = _entry_for(filepath, path, on_disk)
            previous[_WEIGHTS] = np.asarray(on_disk)
        except (ValueError, OSError):
            previous = {}

    def commit(written):
        store = stamped(state, signature)
        store[_WEIGHTS] = np.asarray(digest(written))
        store.update({_PREVIOUS + key: value for key, value in previous.items()})
        _write(path, store)

    if sharded:
        save_weights(written_as)
        commit(filepath)
    else:
        save_atomically(save_weights, filepath, before_rename=commit)


def stamped(state: dict, signature: dict) -> dict:
    """A saved state's entries: the state's own (`saving.PREFIX` names) with the
    format and the signature (the model and window rule it is for)."""
    store = {_FORMAT: np.asarray(format_of(state)),
             _SIGNATURE: np.asarray(json.dumps(signature, sort_keys=True))}
    store.update({key: np.asarray(value) for key, value in state.items()})
    return store


def format_of(state: dict) -> int:
    """The format a saved state is written in (`READS`)."""
    flag = state.get(saving.PREFIX + "outside_fit")
    return FORMAT_OUTSIDE_FIT if flag is not None and np.any(flag) else FORMAT


def keras_save(filepath, overwrite, args, kwargs) -> tuple[bool, bool]:
    """What a `save_weights(filepath, overwrite, *args, **kwargs)` call asks, read
    as Keras reads it: whether to go on (an existing file and `overwrite=False`
    ask the user, as Keras does) and whether the save is sharded
    (`max_shard_size`, Keras's third argument)."""
    if not overwrite and os.path.exists(filepath):
        if not kc.ask_to_proceed_with_overwrite(filepath):
            return False, False
    return True, (args[0] if args else kwargs.get("max_shard_size")) is not None


def _resolved(filepath) -> str:
    """A local path with its symbolic links followed (the state file sits beside
    the weights themselves, as a link to them may move); a remote one as given."""
    filepath = os.fspath(filepath)
    return filepath if "://" in filepath else os.path.realpath(filepath)


def save_atomically(save_weights, filepath, before_rename=None, atomic=True,
                    suffix=_SUFFIX) -> None:
    """`save_weights(path)` to a temporary file beside `filepath` (named to end in
    `suffix`, as Keras requires), then renamed over it, so that a kill leaves the
    previous file whole (other paths, sharded or remote, are written in place, and
    so is any save where not `atomic`: Keras shards a `max_shard_size` save
    whatever the name). `before_rename(path)` runs between the write and the
    rename."""
    filepath = os.fspath(filepath)
    atomic = atomic and filepath.endswith(suffix) and "://" not in filepath
    written = filepath
    if atomic:
        # Through a symbolic link, as Keras writes.
        filepath = os.path.realpath(filepath)
        _remove_leftovers(filepath, suffix)
        handle, written = tempfile.mkstemp(
            prefix=_temporary_prefix(filepath, suffix), suffix=suffix,
            dir=os.path.dirname(filepath) or ".")
        os.close(handle)
    try:
        save_weights(written)
        if before_rename is not None:
            before_rename(written)
        if atomic:
            _give_mode(written, filepath)
            os.replace(written, filepath)
            _sync_folder(filepath)
    finally:
        if atomic and os.path.exists(written):
            os.remove(written)


def _temporary_prefix(filepath: str, suffix: str = _SUFFIX) -> str:
    """The start of the name of a save's temporary file."""
    return f".{os.path.basename(filepath)[:-len(suffix)]}.gradaccum-tmp-"


def _remove_leftovers(filepath: str, suffix: str = _SUFFIX) -> None:
    """Removes the temporary files a save to `filepath` killed before its renames
    left (never read: the pair on disk is whole without them)."""
    folder = os.path.dirname(filepath) or "."
    weights = _temporary_prefix(filepath, suffix)
    state = f".{os.path.basename(saving.sidecar(filepath))}.gradaccum-tmp-"
    for name in os.listdir(folder):
        if ((name.startswith(weights) and name.endswith(suffix))
                or name.startswith(state)):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def _give_mode(temporary: str, target: str) -> None:
    """Gives a temporary file (made readable by its owner only) the mode the file
    it replaces has, or the one a new file gets under the process's umask."""
    try:
        mode = os.stat(target).st_mode & 0o777
    except OSError:
        mode = 0o666 & ~_umask()
    os.chmod(temporary, mode)


def _umask() -> int:
    """The process's umask, read without changing it where the system says it
    (setting it to read it would leave other threads' files without it a moment)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _write(path: str, store: dict) -> None:
    """Writes `store` (np.savez) to `path` through a temporary file renamed over
    it, flushed to disk first."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path) or "."
    handle, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.gradaccum-tmp-", dir=folder)
    try:
        with os.fdopen(handle, "wb") as f:
            np.savez(f, **store)
            f.flush()
            os.fsync(f.fileno())
        _give_mode(temporary, path)
        os.replace(temporary, path)
        _sync_folder(path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _sync_folder(path: str) -> None:
    """Flushes a rename in `path`'s folder to disk (where the system allows)."""
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(filepath, signature: dict, skip_mismatch: bool = False) -> dict | None:
    """The state saved with the weights in `filepath` (`saving.PREFIX` names), or
    None where there is none (weights saved without accumulation). A state for
    another model or window rule whose window is empty loads (nothing is lost; a
    rule may change between runs, layers be frozen).
    Raises a ValueError that names the file and the way out where the state file
    cannot be read or does not belong to these weights, or holds an open window
    for another model or window rule (with `skip_mismatch`, Keras's option to
    load what fits, that window is dropped with a warning instead)."""
    given = os.fspath(filepath)
    filepath = _resolved(given)
    path = saving.sidecar(filepath)
    if not os.path.exists(path):
        return None
    if filepath == os.path.abspath(given):
        # Messages name the files as the caller does (no link between).
        filepath, path = given, saving.sidecar(given)
    entry = _entry_for(filepath, path, digest(filepath))
    entry, saved = reordered(entry, json.loads(str(entry.pop(_SIGNATURE))), signature)
    mismatch = _mismatch(saved, signature)
    if mismatch and not _open_window(entry):
        # Nothing open to lose: the counters (a schedule's position, the skips,
        # the epoch's position) go on; the empty window's sums find their
        # variables or are left.
        return entry
    if mismatch and skip_mismatch:
        warnings.warn(
            f"gradaccum drops the open window saved in {path}: it was saved for "
            f"another {mismatch} (load_weights(skip_mismatch=True)).",
            stacklevel=3,
        )
        return None
    if mismatch:
        raise ValueError(
            f"The accumulation state in {path} was saved for another {mismatch}, so "
            f"its open window cannot go on in this one. Load it into the model and "
            "window rule that saved it; or delete the file to load the weights with "
            "an empty window (the open window's micro-batches are lost)."
        )
    return entry


def _open_window(entry: dict) -> bool:
    """Whether a saved state holds micro-batches of an open window."""
    return any(np.any(np.asarray(value)) for key, value in entry.items()
               if key.endswith("micro_step") or key.endswith("window_skipped"))


def check_readable(filepath) -> None:
    """Raises an OSError, as Keras's load does, where a `.weights.h5` file is not
    an HDF5 file (damaged, truncated, overwritten)."""
    filepath = os.fspath(filepath)
    if not filepath.endswith(_SUFFIX):
        return
    import h5py

    with h5py.File(filepath, "r"):
        pass


def _entry_for(filepath: str, path: str, weights_digest: str) -> dict:
    """The entry of the state file `path` saved with the weights whose digest is
    `weights_digest`, with its signature."""
    try:
        with np.load(path, allow_pickle=False) as store:
            values = {key: store[key] for key in store.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as error:
        reason = "not a NumPy archive" if "pickle" in str(error) else str(error)
        raise ValueError(
            f"The accumulation state file {path} cannot be read ({reason}): it is "
            "truncated or damaged. Load a save whose state file is whole; or delete "
            "it to load the weights with an empty window (the open window's "
            "micro-batches are lost)."
        ) from None
    version = values.get(_FORMAT)
    if version is None or int(version) not in READS:
        found = ("gradaccum's first format, saved apart from its weights"
                 if version is None else f"format {int(version)}")
        raise ValueError(
            f"The accumulation state file {path} has {found}; this gradaccum "
            f"reads {READS_TEXT} (the weights and the window state saved as one "
            "pair, tied by the weights' digest). Load it with the gradaccum that "
            "saved it and save again; or delete it to load the weights with an "
            "empty window (the open window's micro-batches are lost)."
        )
    for prefix in ("", _PREVIOUS):
        if str(values.get(prefix + _WEIGHTS, "")) == weights_digest:
            return {key[len(prefix):]: value for key, value in values.items()
                    if key.startswith(prefix) and (prefix or not key.startswith(_PREVIOUS))
                    and key[len(prefix):] not in (_FORMAT, _WEIGHTS)}
    raise ValueError(
        f"The accumulation state file {path} was not saved with the weights in "
        f"{filepath} (a weights file copied, restored or saved without the state "
        "file beside it?): their open window would not be these weights'. Put back "
        "the state file saved with these weights; or delete it to load the weights "
        "with an empty window (the open window's micro-batches are lost)."
    )


def reordered(values: dict, saved: dict, current: dict) -> tuple[dict, dict]:
    """A saved state's `values` and signature `saved` for the model whose signature
    is `current`: where its trainable variables are the saved ones (same paths and
    shapes) in another order (a float8 layer loaded from a `.keras` file builds its
    scales before its kernel), the per-variable entries (each variable's sum, the
    `received` counts) move to the variables' new places. Else as they are."""
    paths, now = saved.get("paths"), current.get("paths")
    if not paths or not now or paths == now or len(set(paths)) != len(paths):
        return values, saved
    shapes = {path: list(shape) for path, shape in zip(paths, saved.get("model") or [])}
    if sorted(paths) != sorted(now) or any(
            shapes.get(path) != list(shape)
            for path, shape in zip(now, current.get("model") or [])):
        return values, saved
    place = {index: now.index(path) for index, path in enumerate(paths)}
    order = [paths.index(path) for path in now]
    moved = {}
    for key, value in values.items():
        match = re.fullmatch(r"(.*accumulator_)(\d+)", key)
        if match and int(match.group(2)) in place:
            moved[match.group(1) + str(place[int(match.group(2))])] = value
        elif key.endswith("received") and np.ndim(value) == 1 and len(value) == len(paths):
            moved[key] = np.asarray(value)[order]
        else:
            moved[key] = value
    return moved, dict(saved, model=current.get("model"), paths=now)


def _mismatch(saved: dict, current: dict) -> str | None:
    """What differs between the signature a state was saved with and the model's
    (None: nothing)."""
    if saved.get("model") != current.get("model"):
        shapes = saved.get("model") or []
        return (f"model (trainable variables of shapes "
                f"{', '.join(str(tuple(s)) for s in shapes)}; this model's: "
                f"{', '.join(str(tuple(s)) for s in current.get('model') or [])})")
    saved_rule, rule = saved.get("window") or {}, current.get("window") or {}
    differs = [name for name in sorted(set(saved_rule) | set(rule))
               if saved_rule.get(name) != rule.get(name)]
    if differs:
        said = ", ".join(f"{name}={saved_rule.get(name)!r}" for name in differs)
        here = ", ".join(f"{name}={rule.get(name)!r}" for name in differs)
        return f"window rule ({said}; this model's: {here})"
    return None
