"""The README's blocks for Keras's JAX backend run as written, and the examples in
the JAX adapter's docstrings."""

from __future__ import annotations

import doctest
import importlib

import pytest

from test_docs import ROOT, python_blocks

BLOCKS = python_blocks(ROOT / "README.md", backend="jax")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_jax_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md JAX block {index}", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("module", ["gradaccum.backends.jax.accumulator"])
def test_the_jax_adapters_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
