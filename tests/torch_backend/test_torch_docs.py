"""The README's blocks for Keras's PyTorch backend run as written, and the examples in
the PyTorch adapter's docstrings."""

from __future__ import annotations

import doctest
import importlib

import pytest

from test_docs import ROOT, python_blocks

BLOCKS = python_blocks(ROOT / "README.md", backend="torch")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_torch_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md PyTorch block {index}", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("module", ["gradaccum.backends.torch.accumulator"])
def test_the_torch_adapters_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
