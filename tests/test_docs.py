"""The README's code runs as written: here the blocks for Keras's TensorFlow backend;
the blocks that choose JAX (`os.environ["KERAS_BACKEND"] = "jax"`) run in the JAX
process (tests/jax_backend/test_jax_docs.py)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX = 'os.environ["KERAS_BACKEND"] = "jax"'


def python_blocks(path, *, jax: bool = False):
    text = path.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [block for block in blocks if (JAX in block) == jax]


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "README.md"))))
def test_readme_python_block_runs(index):
    code = python_blocks(ROOT / "README.md")[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})


def test_the_readme_has_blocks_for_both_backends():
    assert len(python_blocks(ROOT / "README.md")) >= 5
    assert len(python_blocks(ROOT / "README.md", jax=True)) >= 1
