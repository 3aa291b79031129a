"""The package as users get it: `python -m build` makes a wheel and an sdist that
`twine check` accepts, the wheel holds the package (its `py.typed`, its command, its
version from `gradaccum.__version__`) and nothing else, and installed into a fresh
virtual environment it runs `gradaccum train --help` and one window of `accumulate`
on Keras's default backend equal to plain Keras on the window."""

from __future__ import annotations

import email
import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import gradaccum
from test_install import ROOT, _clean_env, _dependencies, _link, _make_venv, _top_level

ONE_WINDOW = """
import keras, numpy as np, gradaccum
def model():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.set_weights([np.full((3, 2), 0.5, "float32"), np.zeros(2, "float32")])
    m.compile(keras.optimizers.SGD(0.1), "mse")
    return m
x = np.arange(24, dtype="float32").reshape(8, 3) / 24
y = np.ones((8, 2), "float32")
window = gradaccum.accumulate(model(), steps=4)
window.fit(x, y, batch_size=2, shuffle=False, verbose=0)
plain = model()
plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
gap = max(float(np.max(np.abs(a - b))) for a, b in zip(window.get_weights(), plain.get_weights()))
print(keras.backend.backend(), int(window.optimizer.iterations), gap < 1e-6, gradaccum.__file__)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The wheel and the sdist `python -m build` makes from a copy of the project."""
    base = tmp_path_factory.mktemp("build")
    project = base / "project"
    shutil.copytree(ROOT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, project / name)
    out = base / "dist"
    made = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(project)],
                          capture_output=True, text=True, timeout=600, env=_clean_env())
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "base": base}


def test_twine_accepts_the_wheel_and_the_sdist(built):
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built["wheel"]),
         str(built["sdist"])], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2


def test_the_wheel_holds_the_package_its_version_and_its_command(built):
    wheel = built["wheel"]
    assert wheel.name == f"gradaccum-{gradaccum.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = f"gradaccum-{gradaccum.__version__}.dist-info"
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert "gradaccum/__init__.py" in names and "gradaccum/py.typed" in names
    assert "gradaccum/core/overwrite.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/"))]
    assert metadata["Version"] == gradaccum.__version__
    assert metadata["Requires-Python"] == ">=3.10"
    assert any(r.startswith("keras") for r in metadata.get_all("Requires-Dist"))
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert "gradaccum = gradaccum.cli:main" in entry_points


def test_the_wheel_installed_in_a_fresh_environment_trains_one_window(built):
    # The environment holds links to this one's Keras and TensorFlow (Keras's default
    # backend) and what they need, and the wheel installed without its dependencies.
    venv = built["base"] / "venv"
    purelib = _make_venv(venv, with_pip=True)
    for name in _dependencies(["keras", "tensorflow", "numpy"], set()):
        _link(_top_level(importlib.metadata.distribution(name)), purelib)
    python = str(venv / "bin" / "python")
    pip = subprocess.run([python, "-m", "pip", "install", "--no-input", "--no-deps",
                          str(built["wheel"])],
                         capture_output=True, text=True, timeout=300, env=_clean_env())
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    env = _clean_env()
    help_ = subprocess.run([str(venv / "bin" / "gradaccum"), "train", "--help"],
                           capture_output=True, text=True, timeout=120, env=env,
                           cwd=built["base"])
    assert help_.returncode == 0, help_.stderr
    assert help_.stdout.startswith("usage: gradaccum train")
    run = subprocess.run([python, "-c", ONE_WINDOW], capture_output=True, text=True,
                         timeout=300, env=env, cwd=built["base"])
    assert run.returncode == 0, run.stderr[-3000:]
    backend, iterations, exact, location = run.stdout.split()[-4:]
    assert (backend, iterations, exact) == ("tensorflow", "1", "True")
    # The installed wheel's package, not this checkout's.
    assert pathlib.Path(location).is_relative_to(purelib)
