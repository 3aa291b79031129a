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
import subprocess
import sys
import sysconfig

import pytest

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


# Defect 4: the library without TensorFlow ------------------------------------------

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
