"""The type hints (issue 56): mypy passes on the package with pyproject.toml's
`[tool.mypy]` (every function of the modules that define the public names annotated),
and `mypy --strict` passes on tests/typing/public_api.py, which uses each public name
as users do: a public callable left unannotated fails it (`no-untyped-call`), as does
an argument or a result of the wrong type."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="mypy is not installed (pip install 'gradaccum[test]' provides it)",
)


def _mypy(*args: str, cache: pathlib.Path) -> subprocess.CompletedProcess:
    """`python -m mypy ARGS` from the repository root (its pyproject.toml's config),
    with a cache of its own."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MYPY_FORCE_COLOR": "0"},
    )


def test_the_package_and_the_public_api_type_check(tmp_path):
    # One cache for both runs: the strict one reads the package's modules (silently)
    # from what the first run cached.
    checked = _mypy(cache=tmp_path)
    assert checked.returncode == 0, checked.stdout[-5000:] + checked.stderr[-3000:]
    assert "Success" in checked.stdout
    strict = _mypy("--strict", "tests/typing/public_api.py", cache=tmp_path)
    assert strict.returncode == 0, strict.stdout[-5000:] + strict.stderr[-3000:]
    assert "Success: no issues found in 1 source file" in strict.stdout
