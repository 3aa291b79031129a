"""The blocks of the README and the docs for Keras's JAX backend run as written, the
examples for JAX (`python examples/jax_custom_loop.py`), and the examples in the JAX
adapter's docstrings."""

from __future__ import annotations

import doctest
import importlib

import pytest

from test_docs import documented_blocks, examples_for, printed_gap, run_block, run_example

BLOCKS = documented_blocks("jax")
EXAMPLES = examples_for("jax")


@pytest.mark.parametrize("label, code", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_documented_jax_block_runs(label, code, monkeypatch):
    run_block(code, label, "jax", monkeypatch)


def test_there_is_an_example_for_jax():
    assert [path.name for path in EXAMPLES] == ["jax_custom_loop.py"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_the_jax_example_runs_as_written(path, monkeypatch, capsys):
    # Micro-batches of 16, 16 and 8 against one step on each window of 40.
    output = run_example(path, "jax", monkeypatch, capsys)
    assert "updates: 11 (micro-batches: 32)" in output
    assert printed_gap(output) < 1e-5


@pytest.mark.parametrize("module", ["gradaccum.backends.jax.accumulator"])
def test_the_jax_adapters_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
