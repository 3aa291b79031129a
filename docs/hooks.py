"""mkdocs hooks: the performance figures are drawn from the benchmarks' JSON
(`scripts/figures.py`) and the floors of the package from its imports
(`scripts/house.py`) before each build, so the site never shows stale ones."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    """The first page's picture of a window (`scripts/diagram.py`)."""
    spec = importlib.util.spec_from_file_location("diagram", ROOT / "scripts" / "diagram.py")
    diagram = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagram)
    diagram.main([str(ROOT / "docs" / "figures" / "accumulation.svg")])
