"""The site's figures read at the page's width (scripts/figures.py, scripts/diagram.py):
each performance figure is drawn at the width of the page's content column with no
text under 9 points, every axis with more than one series has a legend that names
them, and each contender has one colour in every figure; the first page's diagram is
an SVG with a title and a description whose text is 9 points or more where the page
shows it."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import struct
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _script("figures")
diagram = _script("diagram")


@pytest.fixture(scope="module")
def drawn():
    drawn = figures.draw()
    for figure in drawn.values():
        figure.draw_without_rendering()  # lays the figure out and makes its ticks
    return drawn


def _colour(artist) -> str:
    from matplotlib.collections import Collection
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D

    if isinstance(artist, Line2D):
        return to_hex(artist.get_color())
    if isinstance(artist, Collection):
        return to_hex(artist.get_edgecolor()[0])
    return to_hex(artist.get_facecolor())


def _series(ax) -> set:
    """The styles of the data drawn on `ax` (colour, and a line's style and marker),
    leaving out the neutral line at a ratio of 1 and black error bars."""
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D

    lines, others = set(), set()
    for artist in [*ax.lines, *ax.patches, *ax.collections]:
        colour = _colour(artist)
        if artist.get_gid() == "equal" or colour == figures.EQUAL:
            continue
        if not isinstance(artist, Line2D):
            others.add((colour,))
        elif artist.get_marker() not in ("_", "|"):  # not an error bar's cap
            lines.add((colour, artist.get_linestyle(), artist.get_marker(),
                       to_hex(artist.get_markerfacecolor())))
    # A line's error bars (a collection of its colour) are part of its series.
    return lines | {style for style in others if style[0] not in {s[0] for s in lines}}


def _legend_entries(figure, ax) -> list[tuple[str, str]]:
    legends = [legend for legend in (ax.get_legend(), *figure.legends) if legend]
    return [(_colour(handle), text.get_text()) for legend in legends
            for handle, text in zip(legend.legend_handles, legend.get_texts())]


def test_every_figure_is_the_pages_width_with_no_text_under_9_points(drawn):
    from matplotlib.text import Text

    assert set(drawn) == {"throughput", "memory", "gpu", "backends", "noise-scale"}
    assert figures.SMALLEST >= 9
    # A figure as wide as the content column (about 670-740 px at 96 px per inch) is
    # shown at about its size: its points are the reader's.
    assert 6.5 <= figures.WIDTH <= 7.5
    for name, figure in drawn.items():
        assert figure.get_size_inches()[0] == pytest.approx(figures.WIDTH), name
        texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert len(texts) > 10, name
        small = [(t.get_text(), t.get_fontsize()) for t in texts
                 if t.get_fontsize() < figures.SMALLEST]
        assert not small, (name, small)


def test_every_axis_with_more_than_one_series_has_a_legend_naming_them(drawn):
    checked = 0
    for name, figure in drawn.items():
        for ax in figure.axes:
            series = _series(ax)
            if len(series) < 2:
                continue
            checked += 1
            entries = _legend_entries(figure, ax)
            assert len(entries) >= len(series), (name, series, entries)
            assert {s[0] for s in series} <= {colour for colour, _ in entries}, name
    assert checked >= 5


def test_each_contender_has_one_colour_in_every_figure(drawn):
    assert len(set(figures.COLOURS.values())) == len(figures.COLOURS)
    contender = {colour.lower(): name for name, colour in figures.COLOURS.items()}
    seen: dict[str, set] = {}
    for name, figure in drawn.items():
        for ax in figure.axes:
            for style in _series(ax):  # no colour outside the table
                assert style[0] in contender, (name, style)
            for colour, label in _legend_entries(figure, ax):
                assert colour in contender, (name, label, colour)
                # The entry names the contender whose colour it has.
                assert contender[colour] in label, (name, label, contender[colour])
                for other in figures.COLOURS:
                    if other in label:
                        seen.setdefault(other, set()).add(colour)
    assert {"gradaccum", "Keras's built-in", "plain fit at b"} <= set(seen)
    assert all(len(colours) == 1 for colours in seen.values()), seen


def test_the_figures_are_written_as_png_at_the_pages_width(tmp_path):
    assert figures.main([str(tmp_path)]) == 0
    for name in ("throughput", "memory", "gpu", "backends", "noise-scale"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        width, _ = struct.unpack(">II", data[16:24])
        assert width == round(figures.WIDTH * figures.DPI), (name, width)


def _font_sizes(root) -> list[tuple[str, float]]:
    """(text, font size in the picture's units) of every text and tspan, a size
    inherited from the nearest element that sets one."""
    found = []

    def walk(element, size):
        size = float(element.get("font-size", size))
        tag = element.tag.rsplit("}", 1)[-1]
        if tag in ("text", "tspan") and (element.text or "").strip():
            found.append((element.text, size))
        for child in element:
            walk(child, size)

    walk(root, 16.0)  # a browser's default
    return found


def test_the_diagram_has_a_title_and_text_of_9_points_at_the_pages_width(tmp_path):
    out = tmp_path / "accumulation.svg"
    assert diagram.main([str(out)]) == 0
    root = ET.fromstring(out.read_text())
    namespace = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{namespace}svg"
    title = root.find(f"{namespace}title")
    assert title is not None and "accumulation" in title.text.lower()
    desc = root.find(f"{namespace}desc")
    assert desc is not None and "one update" in desc.text
    _, _, width, _ = (float(v) for v in root.get("viewBox").split())
    assert float(root.get("width")) == width == diagram.WIDTH
    # Shown in a content column of `COLUMN` px or wider, a unit is COLUMN / width px
    # or more; 9 points are 12 px.
    scale = diagram.COLUMN / width
    sizes = _font_sizes(root)
    assert len(sizes) > 20
    small = [(text, size) for text, size in sizes if size * scale < 12]
    assert not small, small
    words = " ".join(text for text, _ in sizes)
    for shown in ("micro-batch 4", "float32", "ONE update", "S / W"):
        assert shown in words, shown
    assert not re.search(r"/(work|tmp)/", out.read_text())


def test_the_committed_diagram_is_the_scripts_drawing():
    # docs/images/accumulation.svg is in git, for the README and GitHub's view of the
    # docs; the docs build draws it again. `python scripts/diagram.py` after a change.
    assert diagram.OUT.read_text() == diagram.svg(), "run: python scripts/diagram.py"


def test_the_seed_experiments_figure_takes_its_colours_from_the_sites_table():
    # src/gradaccum/experiments/report.py cannot import scripts/: its three colours
    # are the table's own, checked here.
    from gradaccum.experiments import report

    assert report.ACCUMULATED == figures.COLOURS["gradaccum"]
    assert report.LARGE_BATCH == figures.COLOURS["plain fit at k×b"]
    assert report.CONTRAST == figures.COLOURS["plain fit at b"]


def test_the_noise_scale_figure_draws_the_seed_experiments_readings(drawn):
    """docs/figures/noise-scale.png (the guide "Choosing k"): each split's median
    reading at its evaluation points, the batch k x b of the run that follows the
    noise scale, and the splits' 100 samples per update."""
    import json

    import numpy as np

    sweep = json.loads(figures.EXPERIMENT.read_text())
    rows = {row["label"]: row for row in sweep["configs"]}
    (ax,) = drawn["noise-scale"].axes
    lines = {line.get_label(): line for line in ax.lines}
    for label in ("5x20", "10x10", "20x5"):
        line = lines[f"gradaccum {label}"]
        assert list(line.get_xdata()) == [u for u, _ in rows[label]["runs"][0]["curve"]]
        np.testing.assert_allclose(line.get_ydata(), rows[label]["noise_scale"])
    assert not any(label.startswith("gradaccum 1x100") for label in lines)
    follow = rows["5..50x20 (follows the noise scale)"]
    batch = lines["gradaccum 5..50x20 (follows B_simple): its batch k x b"]
    mean_steps = np.mean([run["steps"] for run in follow["runs"]], axis=0)
    np.testing.assert_allclose(batch.get_ydata(), 20 * mean_steps)
    assert 5 <= mean_steps.min() and mean_steps.max() <= 50
    (seed,) = [line for line in ax.lines if line.get_gid() == "equal"]
    assert list(seed.get_ydata()) == [100, 100]
