"""The README's blocks for Keras's JAX backend run as written."""

from __future__ import annotations

import pytest

from test_docs import ROOT, python_blocks

BLOCKS = python_blocks(ROOT / "README.md", jax=True)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_jax_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md JAX block {index}", "exec"), {"__name__": "readme"})

