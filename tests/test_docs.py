"""The README's code runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks(path):
    text = path.read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "README.md"))))
def test_readme_python_block_runs(index):
    code = python_blocks(ROOT / "README.md")[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})
