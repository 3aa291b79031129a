"""The code of the README, of every page of the documentation site (`docs/`) and of
`examples/` runs as written, on the backend it states.

Every fenced `python` block states its backend first, as keras.io's examples do
(`import os`, then `os.environ["KERAS_BACKEND"] = "jax"`); a block inside a tab
(pymdownx.tabbed: indented) is found and dedented. Here run the blocks and the
examples for Keras's TensorFlow backend; those for JAX and PyTorch run in that
backend's process (tests/jax_backend/test_jax_docs.py,
tests/torch_backend/test_torch_docs.py). Shell commands are fenced `bash`.
"""

from __future__ import annotations

import ast
import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The README, then the site's pages in order of their paths.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
BACKENDS = ("tensorflow", "jax", "torch")

# A fenced block, at any indentation (a tab's content is indented): its opening
# fence, its language, its body, and a closing fence at the same indentation.
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<language>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    flags=re.M | re.S,
)
# The statement of a block's backend, keras.io's way: its first lines (comments and
# blank lines aside) are `import os` and `os.environ["KERAS_BACKEND"] = "..."`.
STATED = re.compile(
    r'\A(?:[ \t]*(?:#[^\n]*)?\n)*import os[ \t]*\n(?:[ \t]*\n)*'
    r'os\.environ\["KERAS_BACKEND"\] = "(?P<backend>\w+)"'
)


def stated_backend(code: str) -> str | None:
    """The backend `code` states in its first lines, or None where it states none."""
    found = STATED.match(code)
    return found.group("backend") if found else None


def chosen_backend(code: str) -> str:
    """The backend a block runs on: the one it states, TensorFlow where it states none
    (`test_every_python_block_states_its_backend` fails for that block)."""
    return stated_backend(code) or "tensorflow"


def fenced_blocks(text: str, language: str = "python") -> list:
    """`(line, code)` of every block of `language` in `text`, dedented (a block inside
    a tab or a list item is indented), with its first line's number."""
    found = []
    for match in FENCE.finditer(text):
        if match.group("language") != language:
            continue
        indent = match.group("indent")
        lines = match.group("body").splitlines(keepends=True)
        code = "".join(line[len(indent):] if line.startswith(indent) else line.lstrip(" \t")
                       for line in lines)
        found.append((text.count("\n", 0, match.start()) + 1, code))
    return found


def all_blocks() -> list:
    """`(label, line, code)` of every `python` block of the README and the docs,
    labelled `page:n` (its page, and its number among the page's python blocks)."""
    found = []
    for page in PAGES:
        for index, (line, code) in enumerate(fenced_blocks(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}:{index}", line, code))
    return found


def documented_blocks(backend: str = "tensorflow") -> list:
    """`(label, code)` of every `python` block of the README and the docs that runs on
    `backend`."""
    return [(label, code) for label, _, code in all_blocks()
            if chosen_backend(code) == backend]


def example_backend(path: pathlib.Path) -> str | None:
    """The backend an example file sets for itself (`os.environ["KERAS_BACKEND"]`)."""
    found = re.search(r'^os\.environ\["KERAS_BACKEND"\] = "(\w+)"', path.read_text(),
                      flags=re.M)
    return found.group(1) if found else None


def examples_for(backend: str) -> list:
    return [path for path in EXAMPLES if example_backend(path) == backend]


def run_block(code: str, label: str, backend: str, monkeypatch) -> None:
    """Runs a documented block as a script would, in this process (its backend's):
    the block's own `os.environ` line is undone afterwards."""
    monkeypatch.setenv("KERAS_BACKEND", backend)
    exec(compile(code, label, "exec"), {"__name__": "docs"})


def run_example(path: pathlib.Path, backend: str, monkeypatch, capsys) -> str:
    """Runs `python examples/<name>.py` in this process (its backend's); returns what
    it printed."""
    monkeypatch.setenv("KERAS_BACKEND", backend)
    runpy.run_path(str(path), run_name="__main__")
    return capsys.readouterr().out


def printed_gap(output: str) -> float:
    """The largest gap to the large-batch reference that an example printed."""
    found = re.search(r"max \|weight - large-batch weight\|: (\S+)", output)
    assert found, f"The example printed no gap to the large batch:\n{output}"
    return float(found.group(1))


BLOCKS = documented_blocks()
EVERY_BLOCK = all_blocks()


@pytest.mark.parametrize("label, code", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_documented_python_block_runs(label, code, monkeypatch):
    run_block(code, label, "tensorflow", monkeypatch)


@pytest.mark.parametrize("label, line, code", EVERY_BLOCK,
                         ids=[label for label, _, _ in EVERY_BLOCK])
def test_every_python_block_states_its_backend(label, line, code):
    backend = stated_backend(code)
    assert backend in BACKENDS, (
        f"{label} (line {line}) must state its backend in its first lines, as "
        'keras.io does: `import os`, then `os.environ["KERAS_BACKEND"] = "tensorflow"` '
        f'(or "jax", "torch"). Received: {backend!r} in a block that begins '
        f"{code[:80]!r}"
    )


def test_the_docs_have_blocks_for_every_backend():
    assert len(BLOCKS) >= 15
    assert len(documented_blocks("jax")) >= 3
    assert len(documented_blocks("torch")) >= 4
    # The README's own quick start is one of them.
    assert any(label.startswith("README.md") for label, _ in BLOCKS)
    # The custom-loops page shows one loop per backend, each in its tab.
    loops = [chosen_backend(code) for label, _, code in EVERY_BLOCK
             if label.startswith("docs/guides/custom-loops.md:")]
    assert sorted(loops) == sorted(BACKENDS)


def test_blocks_inside_tabs_are_found_and_dedented():
    text = (
        'Text.\n\n=== "JAX"\n\n    ```python\n    import os\n'
        '    os.environ["KERAS_BACKEND"] = "jax"\n\n    if True:\n        x = 1\n'
        "    ```\n\n```bash\npython x.py\n```\n"
    )
    [(line, code)] = fenced_blocks(text)
    assert line == 5
    assert code == 'import os\nos.environ["KERAS_BACKEND"] = "jax"\n\nif True:\n    x = 1\n'
    assert stated_backend(code) == "jax"
    assert fenced_blocks(text, "bash") == [(13, "python x.py\n")]


def test_a_block_that_states_no_backend_runs_on_tensorflow_and_is_named():
    assert stated_backend("import keras\n") is None
    assert chosen_backend("import keras\n") == "tensorflow"
    # The statement must come first, not somewhere in the block.
    late = 'import keras\nimport os\nos.environ["KERAS_BACKEND"] = "jax"\n'
    assert stated_backend(late) is None


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_every_example_states_and_sets_its_backend(path):
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring, f"examples/{path.name} must open with a docstring"
    backend = example_backend(path)
    assert backend in BACKENDS, (
        f"examples/{path.name} must set its backend itself before Keras is imported: "
        f'`os.environ["KERAS_BACKEND"] = "..."`. Received: {backend!r}'
    )
    names = {"tensorflow": "TensorFlow:", "jax": "JAX:", "torch": "PyTorch:"}
    assert docstring.splitlines()[0].startswith(names[backend]), (
        f"The first line of examples/{path.name}'s docstring must say its backend "
        f"({names[backend]!r}). Received: {docstring.splitlines()[0]!r}"
    )
    # It sets the backend before anything imports Keras.
    assert source.index("KERAS_BACKEND") < source.index("import keras")


@pytest.mark.parametrize("path", examples_for("tensorflow"),
                         ids=[path.name for path in examples_for("tensorflow")])
def test_the_tensorflow_example_runs_as_written(path, monkeypatch, capsys):
    output = run_example(path, "tensorflow", monkeypatch, capsys)
    if path.name == "distributed.py":
        # fit() then the custom loop, on two replicas: 2 epochs of 64 micro-batches
        # of 64, windows of 4 -> 16 updates per epoch.
        assert "MirroredStrategy: 2 replicas" in output
        assert "updates: [16.0, 32.0]" in output
        assert "epoch 2: updates 32" in output
    else:
        assert printed_gap(output) < 1e-5


def test_the_sites_contract_is_the_shared_one():
    # docs/SEMANTICS.md is the site's copy of the project's shared contract.
    shared = ROOT.parent / "shared" / "SEMANTICS.md"
    if not shared.exists():
        pytest.skip("no ../shared beside this checkout")
    assert (ROOT / "docs" / "SEMANTICS.md").read_text() == shared.read_text(), (
        "docs/SEMANTICS.md is not ../shared/SEMANTICS.md: copy it again")
