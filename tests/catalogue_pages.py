"""The catalogue of bad inputs, read from the documentation: docs/bad-input.md and the
pages of docs/bad-input/, one page per topic. Each entry is a list item

    - **`argument`**: what is refused. ValueError (`entry-name`):

        `` the message, character for character ``

whose lines may wrap (a wrapped line reads as one space). tests/test_catalogue.py and
tests/torch_backend/test_torch_bad_input.py check every entry's message."""

from __future__ import annotations

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES = [DOCS / "bad-input.md", *sorted((DOCS / "bad-input").glob("*.md"))]

HEAD = re.compile(r"- \*\*(.+?)\*\*: (.+)\. (\w+) \(`([a-z0-9-]+)`\):")
MESSAGE = re.compile(r"`` (.*) ``")


def _paragraphs(page: pathlib.Path) -> list[tuple[str, str]]:
    """(first line, the paragraph's lines joined by one space) of each paragraph."""
    found = []
    for block in re.split(r"\n[ \t]*\n", page.read_text()):
        lines = block.strip("\n").splitlines()
        if lines:
            found.append((lines[0], " ".join(line.strip() for line in lines)))
    return found


def entries() -> list[tuple[str, str, str]]:
    """`(name, error type, message)` of every entry of the catalogue, in page order.
    Raises ValueError on an entry the pattern does not read, so that none is left
    unchecked."""
    found = []
    for page in PAGES:
        paragraphs = _paragraphs(page)
        for index, (first, text) in enumerate(paragraphs):
            where = f"{page.name}: {first.strip()}"
            if first.startswith("- **"):
                head = HEAD.fullmatch(text)
                following = paragraphs[index + 1] if index + 1 < len(paragraphs) else None
                message = following and following[0].startswith("    ``") and (
                    MESSAGE.fullmatch(following[1]))
                if not head or not message:
                    raise ValueError(f"an entry the catalogue cannot read: {where}")
                found.append((head.group(4), head.group(3), message.group(1)))
            elif first.startswith("    ``") and not (
                    index and paragraphs[index - 1][0].startswith("- **")):
                raise ValueError(f"a message without its entry: {where}")
    return found
