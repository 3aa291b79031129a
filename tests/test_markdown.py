"""The Markdown of the README, BENCHMARKS.md and every page of the site renders as it
reads (Python-Markdown, which mkdocs uses, is stricter than GitHub's renderer):

- no list glued to a paragraph: a `- `, `* ` or `1. ` line right under a line of a
  paragraph (or of a table) is printed as part of that paragraph, not as a list; a
  blank line must come between;
- no line of a fenced code block over 88 characters (past that the site cuts it
  behind a scrollbar);
- no paragraph (or list item) over 90 words.

Each finding names its file and line. Plain text reading only: nothing is imported but
docs/hooks.py. docs/SEMANTICS.md is a byte-for-byte copy of the project's shared
contract (tests/test_docs.py), which the project does not edit: its glued lists are
separated when the site is built (docs/hooks.py, `on_page_markdown`), and it is
checked here as the site renders it, after that hook; its paragraphs are its authors'
(the word count leaves it out)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md",
         *sorted((ROOT / "docs").rglob("*.md"))]

CODE_LINE = 88
PARAGRAPH_WORDS = 90

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
_ITEM = re.compile(r"^(\s*)([-*]|\d+\.)\s+\S")
_HEADING = re.compile(r"^\s{0,3}#{1,6}(\s|$)")
# Lines that open a block of their own: admonitions, tabs, mkdocstrings' `:::`.
_OPENER = re.compile(r'^\s*(!!!|\?\?\?\+?|===\s+"|:::\s)')
_LINK_TARGET = re.compile(r"\]\([^)]*\)")


def _hooks():
    spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rendered(path: pathlib.Path) -> str:
    """The Markdown of `path` as the site renders it: SEMANTICS.md after the hook that
    separates its lists; every other file as it is."""
    text = path.read_text()
    if path == ROOT / "docs" / "SEMANTICS.md":
        text = _hooks().unglued(text)
    return text


def findings(text: str, name: str, *, words: bool = True) -> list[str]:
    """What `text` (the Markdown of the file `name`) breaks, one `name:line: what`
    each; `words=False` leaves out the paragraphs' length."""
    found = []
    fence = None  # (indent, marker) of the open code fence
    block = []  # the current block: (line number, line) since a blank line or opener
    directive = False  # inside the indented options of a `:::` line

    def close_block():
        if block and words:
            found.extend(_long_units(block, name))
        block.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if fence is not None:
            indent, marker = fence
            stripped = line.strip()
            if stripped.startswith(marker) and not stripped.strip(marker[0]):
                fence = None
                continue
            # The fence's own indentation (a block in a tab) is not the code's.
            width = len(line) - min(indent, len(line) - len(line.lstrip()))
            if width > CODE_LINE:
                found.append(f"{name}:{number}: a code line of {width} characters "
                             f"(at most {CODE_LINE})")
            continue
        opened = _FENCE.match(line)
        if opened:
            close_block()
            fence = (len(opened.group(1)), opened.group(2))
            directive = False
            continue
        if not line.strip():
            close_block()
            directive = False
            continue
        if directive and line[:1].isspace():
            continue
        directive = False
        if _HEADING.match(line) or _OPENER.match(line):
            close_block()
            directive = line.lstrip().startswith(":::")
            continue
        item = _ITEM.match(line)
        if item and block and not _ITEM.match(block[0][1]):
            found.append(f"{name}:{number}: a list glued to the paragraph above it "
                         f"(line {block[-1][0]}): a blank line must come between")
            close_block()
        block.append((number, line))
    close_block()
    return found


def _long_units(block: list[tuple[int, str]], name: str) -> list[str]:
    """The paragraphs of one block over `PARAGRAPH_WORDS` words: the block itself, or
    each item where it is a list; a table or an HTML block counts no words."""
    first = block[0][1].lstrip()
    if first.startswith(("|", "<", "$$")):
        return []
    units, unit = [], []
    for number, line in block:
        if _ITEM.match(line) and unit:
            units.append(unit)
            unit = []
        unit.append((number, line))
    units.append(unit)
    long = []
    for unit in units:
        text = " ".join(line for _, line in unit)
        words = len(_LINK_TARGET.sub("]", _ITEM.sub(r"\1x", text, count=1)).split())
        if words > PARAGRAPH_WORDS:
            long.append(f"{name}:{unit[0][0]}: a paragraph of {words} words "
                        f"(at most {PARAGRAPH_WORDS}): split it or make it a list")
    return long


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_markdown_renders_as_it_reads(path):
    # The shared contract's paragraphs are not the project's to split (see above).
    shared = path == ROOT / "docs" / "SEMANTICS.md"
    found = findings(rendered(path), str(path.relative_to(ROOT)), words=not shared)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("text", "expected"), [
    ("A paragraph:\n- one\n- two\n", ["x:2: a list glued"]),
    ("A paragraph:\n1. one\n", ["x:2: a list glued"]),
    ("| a | b |\n| - | - |\n* one\n", ["x:3: a list glued"]),
    ("- an item\n  wrapped\n- and another\n    - nested\n", []),
    ("- an item\n\n    its second paragraph\n- glued to it\n", ["x:4: a list glued"]),
    ("## A heading\n- a list right under it\n", []),
    ("A paragraph:\n\n- one\n", []),
    ("```python\nx = 1\n- 2\n```\n", []),
    ("```python\n" + "x" * 89 + "\n```\n", ["x:2: a code line of 89"]),
    ('=== "JAX"\n\n    ```python\n    ' + "x" * 88 + "\n    ```\n", []),
    ('=== "JAX"\n\n    ```python\n    ' + "x" * 89 + "\n    ```\n", ["x:4: a code line"]),
    ("word " * 91, ["x:1: a paragraph of 91 words"]),
    ("- " + "word " * 50 + "\n- " + "word " * 50, []),
    ("[a link](" + "very/long/" * 30 + ") " + "word " * 88, []),
    ("::: gradaccum.wrap\n    options:\n      members:\n        - wrap\n", []),
])
def test_the_checker_finds_what_it_should(text, expected):
    found = findings(text, "x")
    assert len(found) == len(expected), found
    for line, start in zip(found, expected):
        assert line.startswith(start), (line, start)


def test_the_hook_separates_glued_lists_as_the_checker_wants_them():
    text = ("A paragraph:\n- one\n  wrapped\n- two\n\n```text\nx\n- y\n```\n"
            "| a |\n| - |\n1. three\n")
    assert len(findings(text, "x")) == 2
    separated = _hooks().unglued(text)
    assert not findings(separated, "x")
    assert separated == text.replace(":\n- one", ":\n\n- one").replace(
        "|\n1. three", "|\n\n1. three")
