"""What a user sees on an install that lacks TensorFlow or the experiment extra.

Each test builds a real environment in which the packages are absent (a fresh virtual
environment holding links to this one's packages, minus the missing ones), so an
import fails exactly as it would for someone who never installed them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = pathlib.Path(sysconfig.get_paths()["purelib"])

MISSING_TENSORFLOW = (
    "gradaccum needs TensorFlow >= 2.16. Install it with one of:\n"
    "  pip install 'gradaccum[cpu]'   # CPU-only TensorFlow (smaller)\n"
    "  pip install 'gradaccum[gpu]'   # TensorFlow with CUDA (Linux GPUs)\n"
    "  pip install 'gradaccum[tf]'    # the standard `tensorflow` wheel"
)


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "KERAS_BACKEND")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _make_venv(path: pathlib.Path, *, with_pip: bool) -> pathlib.Path:
    """A fresh virtual environment (no system site packages); returns its purelib."""
    command = [sys.executable, "-m", "venv", str(path)]
    if not with_pip:
        command.insert(3, "--without-pip")
    made = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtual environment here: {made.stderr.strip()}")
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_clean_env(),
    ).stdout.strip()
    return pathlib.Path(purelib)


def _top_level(dist: importlib.metadata.Distribution) -> set[str]:
    """The names a distribution installed directly in site-packages."""
    return {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}


def _link(names, target: pathlib.Path) -> None:
    for name in sorted(names):
        source, link = SITE / name, target / name
        if source.exists() and not link.exists():
            link.symlink_to(source)


def _dependencies(requirements: list[str], extras: set[str]) -> set[str]:
    """The installed distributions `requirements` (with `extras`) pull in, recursively."""
    found, todo = set(), [(text, extras) for text in requirements]
    while todo:
        text, active = todo.pop()
        requirement = Requirement(text)
        if requirement.marker and not any(
            requirement.marker.evaluate({"extra": extra}) for extra in active | {""}
        ):
            continue
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pip fetches it from its index, or says why not
        found.add(name)
        todo += [(r, set(requirement.extras)) for r in dist.requires or ()]
    return found


# The library without TensorFlow ------------------------------------------

_PROBE = """
import importlib.util, json
import gradaccum

report = {
    "tensorflow_found": importlib.util.find_spec("tensorflow") is not None,
    "keras_found": importlib.util.find_spec("keras") is not None,
    "version": gradaccum.__version__,
    "names": sorted((set(gradaccum.__all__) | set(gradaccum._EXPORTS)) - {"__version__"}),
    "errors": {},
}
for name in report["names"]:
    try:
        getattr(gradaccum, name)
    except Exception as error:
        report["errors"][name] = [type(error).__name__, str(error)]
    else:
        report["errors"][name] = None
try:
    from gradaccum import wrap  # noqa: F401
except Exception as error:
    report["errors"]["from gradaccum import wrap"] = [type(error).__name__, str(error)]
print(json.dumps(report))
"""


@pytest.mark.parametrize("absent", [("tensorflow",), ("tensorflow", "keras")],
                         ids=["keras-without-tensorflow", "neither"])
def test_every_public_name_says_which_extra_to_install_without_tensorflow(tmp_path, absent):
    purelib = _make_venv(tmp_path / "venv", with_pip=False)
    hidden = set()
    for dist in importlib.metadata.distributions(path=[str(SITE)]):
        top = _top_level(dist)
        if {name.removesuffix(".py") for name in top} & set(absent):
            hidden |= top
    assert hidden, f"this environment has no {absent} to hide"
    _link({entry.name for entry in SITE.iterdir()} - hidden - {"__pycache__"}, purelib)
    # gradaccum from this checkout, as the editable install has it.
    (purelib / "gradaccum_checkout.pth").write_text(f"{ROOT / 'src'}\n")

    run = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", _PROBE],
                         capture_output=True, text=True, timeout=120, env=_clean_env(),
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert not report["tensorflow_found"]
    assert report["keras_found"] == ("keras" not in absent)
    assert report["version"] == "0.1.0"
    assert {"GradientAccumulator", "AccumulatingModel", "BatchNormalization",
            "convert_batch_normalization", "CountingCrossDeviceOps", "wrap"} <= set(
                report["names"])
    expected = ["ImportError", MISSING_TENSORFLOW]
    assert report["errors"] == {
        name: expected for name in [*report["names"], "from gradaccum import wrap"]
    }


# The command on the base install -----------------------------------------------------

EXPERIMENT_MISSING = (
    "the experiment extra is not installed (missing: {}). "
    "Install it with: pip install 'gradaccum[experiment]'"
)
# Without any backend the command picks JAX, the fastest on a CPU.
BOTH_MISSING = (
    "jax and the experiment extra are not installed (missing: jax, {}). "
    "Install them with: pip install 'gradaccum[jax,experiment]'"
)


@pytest.fixture(scope="module")
def cpu_install(tmp_path_factory):
    """A fresh venv after `pip install 'gradaccum[cpu]'`, the README's CPU install
    (`[tf]` where this environment holds the standard TensorFlow wheel).

    TensorFlow and the other dependencies are this environment's own, linked in so
    that pip finds them satisfied and downloads nothing but its build backend;
    gradaccum is built from a copy of the checkout and installed by pip, console
    script included.
    """
    base = tmp_path_factory.mktemp("cpu-install")
    purelib = _make_venv(base / "venv", with_pip=True)
    requirements = importlib.metadata.requires("gradaccum") or []
    # The extra whose TensorFlow wheel this environment holds: `cpu` (tensorflow-cpu)
    # for users, `tf` (the standard wheel) where the test install put KerasHub.
    extra = "cpu" if _installed("tensorflow-cpu") else "tf"
    for name in _dependencies(requirements, {extra}) - {"gradaccum"}:
        _link(_top_level(importlib.metadata.distribution(name)), purelib)
    project = base / "project"
    shutil.copytree(ROOT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    pip = subprocess.run(
        [str(base / "venv" / "bin" / "python"), "-m", "pip", "install", "--no-input",
         f"{project}[{extra}]"],
        capture_output=True, text=True, timeout=300, env=_clean_env(), cwd=base,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    assert "Downloading" not in pip.stdout  # TensorFlow and co. were found installed
    return base / "venv"


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _run(venv: pathlib.Path, *argv: str, python: bool = False) -> subprocess.CompletedProcess:
    """Runs the `gradaccum` command pip installed, or that script under `venv`'s python
    (a copied venv's scripts still name the original's python)."""
    command = [str(venv / "bin" / "gradaccum"), *argv]
    if python:
        command.insert(0, str(venv / "bin" / "python"))
    return subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=_clean_env(), cwd=venv.parent)


def _found(venv: pathlib.Path, module: str) -> bool:
    probe = f"import importlib.util; print(importlib.util.find_spec({module!r}) is not None)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True,
                         text=True, check=True, env=_clean_env()).stdout
    return out.strip() == "True"


def test_console_script_says_which_extra_it_needs(cpu_install):
    assert _found(cpu_install, "tensorflow") and _found(cpu_install, "keras")
    assert not any(_found(cpu_install, m) for m in ("tqdm", "matplotlib", "jax", "torch"))

    help_ = _run(cpu_install, "--help")
    assert help_.returncode == 0, help_.stderr
    assert "{train,sweep}" in help_.stdout
    # Arguments are still checked first, and with their own message.
    bad = _run(cpu_install, "train", "--iterations", "0")
    assert (bad.returncode, bad.stderr) == (
        2, "gradaccum train: error: argument --iterations: must be an integer >= 1, got '0'\n")

    for argv, missing in [
        (["train", "--iterations", "1"], "tqdm"),
        (["train", "--iterations", "1", "--data", "mnist"], "tqdm"),
        (["sweep", "--runs", "1", "--updates", "1"], "tqdm, matplotlib"),
    ]:
        run = _run(cpu_install, *argv)
        assert (run.returncode, run.stdout) == (2, ""), run.stderr
        assert run.stderr == f"gradaccum {argv[0]}: error: {EXPERIMENT_MISSING.format(missing)}\n"


def test_console_script_without_tensorflow_says_so_in_one_line(cpu_install, tmp_path):
    venv = tmp_path / "venv"
    shutil.copytree(cpu_install, venv, symlinks=True)
    purelib = pathlib.Path(next(venv.glob("lib/python*/site-packages")))
    wheel = "tensorflow-cpu" if _installed("tensorflow-cpu") else "tensorflow"
    removed = _top_level(importlib.metadata.distribution(wheel))
    for name in removed:
        (purelib / name).unlink()
    assert not _found(venv, "tensorflow")

    for argv, missing in [
        (["train", "--iterations", "1"], "tqdm"),
        (["sweep", "--runs", "1"], "tqdm, matplotlib"),
    ]:
        run = _run(venv, *argv, python=True)
        assert (run.returncode, run.stdout) == (2, ""), run.stderr
        assert run.stderr == f"gradaccum {argv[0]}: error: {BOTH_MISSING.format(missing)}\n"
