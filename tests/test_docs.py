"""The code of the README and of every page of the documentation site (`docs/`)
runs as written: here the blocks for Keras's TensorFlow backend; the blocks that
choose JAX or PyTorch (`os.environ["KERAS_BACKEND"] = "jax"`) run in that backend's
process (tests/jax_backend/test_jax_docs.py, tests/torch_backend/test_torch_docs.py).
Every fenced `python` block runs; shell commands are fenced `bash`."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The README, then the site's pages in order of their paths.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def chosen_backend(block: str) -> str:
    """The backend a block chooses (`os.environ["KERAS_BACKEND"] = ...`), TensorFlow
    where it chooses none."""
    found = re.search(r'os\.environ\["KERAS_BACKEND"\] = "(\w+)"', block)
    return found.group(1) if found else "tensorflow"


def python_blocks(path, *, backend: str = "tensorflow"):
    text = path.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [block for block in blocks if chosen_backend(block) == backend]


def documented_blocks(backend: str = "tensorflow") -> list:
    """`(label, code)` of every `python` block of the README and the docs that runs on
    `backend`, labelled by its page and its number there."""
    found = []
    for page in PAGES:
        for index, block in enumerate(python_blocks(page, backend=backend)):
            found.append((f"{page.relative_to(ROOT)}:{index}", block))
    return found


BLOCKS = documented_blocks()


@pytest.mark.parametrize("label, code", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_documented_python_block_runs(label, code):
    exec(compile(code, label, "exec"), {"__name__": "docs"})


def test_the_docs_have_blocks_for_every_backend():
    assert len(BLOCKS) >= 15
    assert len(documented_blocks("jax")) >= 2
    assert len(documented_blocks("torch")) >= 2
    # The README's own quick start is one of them.
    assert any(label.startswith("README.md") for label, _ in BLOCKS)


def test_the_sites_contract_is_the_shared_one():
    # docs/SEMANTICS.md is the site's copy of the project's shared contract.
    shared = ROOT.parent / "shared" / "SEMANTICS.md"
    if not shared.exists():
        pytest.skip("no ../shared beside this checkout")
    assert (ROOT / "docs" / "SEMANTICS.md").read_text() == shared.read_text(), (
        "docs/SEMANTICS.md is not ../shared/SEMANTICS.md: copy it again")
