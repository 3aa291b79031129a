"""mkdocs hooks: the performance figures are drawn from the benchmarks' JSON
(`scripts/figures.py`) and the floors of the package from its imports
(`scripts/house.py`) before each build, so the site never shows stale ones.

docs/SEMANTICS.md, a byte-for-byte copy of the project's shared contract, has lists
right under a paragraph line, which Python-Markdown prints as part of the paragraph:
`on_page_markdown` puts the missing blank line before them on that page
(tests/test_markdown.py checks the page as rendered).

The site's name carries the package's version (`gradaccum.__version__`, read from the
source as setuptools reads it, without importing the package), and MathJax, from the
`docs` extra's django-static-mathjax (MathJax's own files, packaged for Python), is
copied into the site under assets/mathjax/, so formulas render without fetching
anything at run time."""

from __future__ import annotations

# (mkdocs is imported where a build needs it: tests/test_markdown.py imports this
# module for `unglued` without the `docs` extra.)
import ast
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATHJAX = "assets/mathjax"
# MathJax's whole TeX input (no extension loaded at run time) and CommonHTML output,
# and the fonts that output loads from beside it.
MATHJAX_FILES = ("tex-chtml-full.js", "output/chtml/fonts/woff-v2/*.woff")


def version() -> str:
    """`gradaccum.__version__`, read from src/gradaccum/__init__.py."""
    from mkdocs.exceptions import PluginError
    tree = ast.parse((ROOT / "src" / "gradaccum" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(target, "id", None) == "__version__" for target in node.targets):
            return ast.literal_eval(node.value)
    raise PluginError("src/gradaccum/__init__.py sets no __version__")


def mathjax_root() -> pathlib.Path:
    """MathJax's es5/ folder, as django-static-mathjax installs it."""
    from mkdocs.exceptions import PluginError
    spec = importlib.util.find_spec("mathjax")
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = pathlib.Path(list(spec.submodule_search_locations)[0]) / "static" / (
            "mathjax") / "es5"
    if folder is None or not (folder / MATHJAX_FILES[0]).is_file():
        raise PluginError("MathJax is not installed: the `docs` extra brings it "
                          "(pip install -e '.[docs]', or bash scripts/docs.sh)")
    return folder


def on_config(config, **kwargs):
    suffix = f" {version()}"
    if not config.site_name.endswith(suffix):  # (`mkdocs serve` may come back here)
        config.site_name += suffix
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File
    root = mathjax_root()
    # Its licence (Apache 2.0) goes with it.
    for path in [root.parent / "LICENSE",
                 *(path for pattern in MATHJAX_FILES for path in sorted(root.glob(pattern)))]:
        uri = f"{MATHJAX}/{path.relative_to(root).as_posix()}" if path.parent != (
            root.parent) else f"{MATHJAX}/{path.name}"
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files

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


# The search's weight of a page (mkdocs-material's `search.boost`, 1 by default):
# what a user looks for comes before the project's own records.
SEARCH_BOOST = {
    "troubleshooting.md": 2.0,
    "experiment.md": 0.5,
    "benchmarks.md": 0.5,
    "development.md": 0.5,
    "architecture.md": 0.5,
    "adapters.md": 0.5,
}


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    boost = SEARCH_BOOST.get(page.file.src_uri)
    if boost is not None:
        page.meta.setdefault("search", {}).setdefault("boost", boost)
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
    draw_accumulation()


def draw_accumulation() -> None:
    """The first page's picture of a window (`scripts/diagram.py`), kept in git too
    (docs/images/: the README and a page read on GitHub show it; a test checks it is
    the script's drawing)."""
    spec = importlib.util.spec_from_file_location("diagram", ROOT / "scripts" / "diagram.py")
    diagram = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagram)
    diagram.main([str(diagram.OUT)])
