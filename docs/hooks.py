"""mkdocs hooks: the performance figures are drawn from the benchmarks' JSON
(`scripts/figures.py`) and the floors of the package from its imports
(`scripts/house.py`) before each build, so the site never shows stale ones.

docs/SEMANTICS.md, a byte-for-byte copy of the project's shared contract, has lists
right under a paragraph line, which Python-Markdown prints as part of the paragraph:
`on_page_markdown` puts the missing blank line before them on that page
(tests/test_markdown.py checks the page as rendered)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_ITEM = re.compile(r"^\s*([-*]|\d+\.)\s+\S")
_BOUNDARY = re.compile(r'^\s{0,3}#{1,6}(\s|$)|^\s*(!!!|\?\?\?|===\s+"|:::\s)')


def unglued(markdown: str) -> str:
    """`markdown` with a blank line before each list that follows a paragraph (or a
    table) line directly, outside code fences."""
    lines, fence, opened_by = [], None, None  # opened_by: the first line of the block
    for line in markdown.split("\n"):
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            lines.append(line)
            continue
        found = _FENCE.match(line)
        if found:
            fence, opened_by = found.group(1), None
        elif not line.strip() or _BOUNDARY.match(line):
            opened_by = None
        elif opened_by is None:
            opened_by = line
        elif _ITEM.match(line) and not _ITEM.match(opened_by):
            lines.append("")
            opened_by = line
        lines.append(line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "SEMANTICS.md":
        return unglued(markdown)
    return markdown


def on_pre_build(config, **kwargs) -> None:
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    figures.main([str(ROOT / "docs" / "figures")])
    spec = importlib.util.spec_from_file_location("house", ROOT / "scripts" / "house.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    (ROOT / "docs" / "figures" / "house.svg").write_text(house.svg())
