"""The README's code runs as written: here the blocks for Keras's TensorFlow backend;
the blocks that choose JAX or PyTorch (`os.environ["KERAS_BACKEND"] = "jax"`) run in
that backend's process (tests/jax_backend/test_jax_docs.py,
tests/torch_backend/test_torch_docs.py)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def chosen_backend(block: str) -> str:
    """The backend a README block chooses (`os.environ["KERAS_BACKEND"] = ...`),
    TensorFlow where it chooses none."""
    found = re.search(r'os\.environ\["KERAS_BACKEND"\] = "(\w+)"', block)
    return found.group(1) if found else "tensorflow"


def python_blocks(path, *, backend: str = "tensorflow"):
    text = path.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [block for block in blocks if chosen_backend(block) == backend]


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "README.md"))))
def test_readme_python_block_runs(index):
    code = python_blocks(ROOT / "README.md")[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})


def test_the_readme_has_blocks_for_every_backend():
    assert len(python_blocks(ROOT / "README.md")) >= 5
    assert len(python_blocks(ROOT / "README.md", backend="jax")) >= 1
    assert len(python_blocks(ROOT / "README.md", backend="torch")) >= 2
