"""The blocks of the README and the docs for Keras's JAX backend run as written, and
the examples in the JAX adapter's docstrings."""

from __future__ import annotations

import doctest
import importlib

import pytest

from test_docs import documented_blocks

BLOCKS = documented_blocks("jax")


@pytest.mark.parametrize("label, code", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_documented_jax_block_runs(label, code):
    exec(compile(code, label, "exec"), {"__name__": "docs"})


@pytest.mark.parametrize("module", ["gradaccum.backends.jax.accumulator"])
def test_the_jax_adapters_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
