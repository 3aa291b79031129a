"""The package's floors hold (scripts/house.py): no import circle anywhere in
src/gradaccum or benchmarks/, lazy and TYPE_CHECKING imports included, no module
imports a module of a higher floor (core/ imports nothing of gradaccum outside it),
and no module is over 600 lines nor any class over 300 lines of code."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("house", ROOT / "scripts" / "house.py")
house = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house)


def test_no_import_circle_and_no_floor_climbed():
    assert house.faults() == []
    assert house.script_circles(ROOT / "benchmarks") == []


def test_every_module_stands_on_a_floor_and_core_imports_only_core():
    known = house.modules()
    edges = house.imports(known)
    for name in known:
        house.floor_of(name)  # raises for a module on no floor
    core = [n for n in known if n.startswith("gradaccum.core")]
    assert len(core) >= 10
    assert {t for n in core for t in edges[n]} <= set(core)


def _package(tmp_path, files):
    for relative, text in files.items():
        path = tmp_path / "gradaccum" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "gradaccum"


def test_a_lazy_circle_and_a_climb_are_found(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/options.py": "def f():\n    from gradaccum import adapter\n",
        "adapter.py": "from gradaccum.core import options\n",
        "epochs.py": "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from gradaccum.exact_epochs import x\n",
        "exact_epochs.py": "from gradaccum import epochs\n",
        "core/window.py": "import importlib\n"
                          "def f():\n    importlib.import_module('gradaccum.attach')\n",
        "core/hints.py": "def f():\n    __import__('gradaccum.adapter')\n",
        "attach.py": "",
    })
    found = house.faults(package)
    assert "import circle: gradaccum.adapter <-> gradaccum.core.options" in found
    assert "import circle: gradaccum.epochs <-> gradaccum.exact_epochs" in found
    assert ("climbs: gradaccum.core.options (core) imports gradaccum.adapter "
            "(the adapter)") in found
    assert ("climbs: gradaccum.core.window (core) imports gradaccum.attach "
            "(the public API)") in found
    assert ("climbs: gradaccum.core.hints (core) imports gradaccum.adapter "
            "(the adapter)") in found


def _defines(path: pathlib.Path, dotted: str) -> bool:
    """Whether the module at `path` defines `dotted` (`f`, or `Class.method`)."""
    import ast

    scope = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = [node for node in scope
                 if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == part]
        if not found:
            return False
        scope = found[0].body
    return True


def test_the_architecture_pages_walk_names_functions_that_exist():
    import re

    page = (ROOT / "docs" / "architecture.md").read_text()
    walk = page[page.index("## One micro-batch"):page.index("## Where to make a change")]
    stops = re.findall(r"`([a-z_/]+\.py)` `([A-Za-z_.]+)`", walk)
    assert len(stops) >= 12
    for path, name in stops:
        assert _defines(ROOT / "src" / "gradaccum" / path, name), f"{path} {name}"


def test_a_long_module_and_a_long_class_are_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(301))
    package = _package(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/long.py": "# comment\n" * 601,
        "core/big.py": f'class Big:\n    """Doc."""\n{body}\n',
    })
    found = house.faults(package)
    assert "too long: gradaccum.core.long has 601 lines (at most 600)" in found
    assert ("too long: class gradaccum.core.big.Big has 302 lines of code "
            "(at most 300)") in found
