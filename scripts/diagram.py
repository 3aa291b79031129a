"""The first page's picture of how accumulation works, drawn as plain SVG.

    python scripts/diagram.py [OUT_FILE]     (default: docs/images/accumulation.svg)

k = 4 micro-batches of b samples each go through the model in turn; each gives its
gradient g_i and its weight w_i (its number of samples or tokens); the weighted
gradients are added into one float32 sum; when the window closes the sum is divided by
the total weight and the optimizer makes one update, the update of one step on the
whole batch of k x b samples.

The picture is `WIDTH` units wide and the page shows it at about that many pixels, so
its font sizes are the reader's: none is under `SMALLEST` pixels, which keeps the text
at 9 points (12 px) or more down to a content column of `COLUMN` pixels. It is a white
card, so it reads on the light and the dark theme alike. The mkdocs hook
(`docs/hooks.py`) draws it before each build; tests/test_figures.py checks it.
"""

from __future__ import annotations

import pathlib
import re
import sys
from xml.sax.saxutils import escape

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "images" / "accumulation.svg"

WIDTH = 700     # the viewBox's width, and the width the page shows it at
COLUMN = 670    # the narrowest content column of the site's theme, in px
SMALLEST = 13   # px: 13 * 670 / 700 = 12.4 px, over 9 pt (12 px) at that column
FONT = 14
STEPS = 4

TITLE = "How accumulation works: four micro-batches, one optimizer update"
DESC = ("Four micro-batches of b samples each go through the model one after another. "
        "Each gives its gradient g_i and its weight w_i, its number of samples or "
        "tokens. The weighted gradients w_i g_i are added into one float32 sum S and "
        "the weights into W. When the window closes, after the fourth micro-batch, "
        "the optimizer makes one update with g = S / W, the same update as one step "
        "on the whole batch of 4 x b samples. The sums are then emptied for the next "
        "window.")

INK = "#1e293b"
MUTED = "#475569"
FILLS = {"batch": "#dbeafe", "model": "#fef3c7", "gradient": "#e0e7ff",
         "sum": "#dcfce7", "update": "#fee2e2"}
STROKE = "#334155"


def _rich(text: str) -> str:
    """`text` as SVG text content, `x_1` written as x with a subscript 1."""
    parts = re.split(r"_(\w)", text)
    out = escape(parts[0])
    for index in range(1, len(parts), 2):
        out += (f'<tspan dy="4" font-size="{SMALLEST}">{escape(parts[index])}</tspan>'
                f'<tspan dy="-4">{escape(parts[index + 1])}</tspan>')
    return out


def _text(x: float, y: float, text: str, *, size: int = FONT, bold: bool = False,
          anchor: str = "start", fill: str = INK) -> str:
    # xml:space="preserve": a renderer may drop a space at a subscript's edge else.
    weight = ' font-weight="bold"' if bold else ""
    return (f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{weight} xml:space="preserve">{_rich(text)}</text>')


def _box(x: float, y: float, width: float, height: float, kind: str) -> str:
    return (f'<rect x="{x}" y="{y}" width="{width}" height="{height}" rx="6" '
            f'fill="{FILLS[kind]}" stroke="{STROKE}"/>')


def _arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{STROKE}" '
            'stroke-width="1.5" marker-end="url(#head)"/>')


def svg(steps: int = STEPS) -> str:
    """The picture, as the text of an SVG file."""
    top, row, box = 84, 58, 46          # the first row's top, a row's pitch, its box
    columns = {"batch": (20, 130), "model": (178, 130), "gradient": (336, 130),
               "sum": (494, 186)}
    bottom = top + (steps - 1) * row + box
    close_y = bottom + 30
    height = close_y + 62 + 76
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" role="img" aria-labelledby="title desc" '
           'font-family="Helvetica, Arial, sans-serif">',
           f'<title id="title">{escape(TITLE)}</title>',
           f'<desc id="desc">{escape(DESC)}</desc>',
           '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" '
           'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
           f'<path d="M0,0 L10,5 L0,10 z" fill="{STROKE}"/></marker></defs>',
           f'<rect x="0.5" y="0.5" width="{WIDTH - 1}" height="{height - 1}" rx="10" '
           'fill="#ffffff" stroke="#cbd5e1"/>',
           _text(20, 32, f"One window: k = {steps} micro-batches of b samples, "
                 "one update", size=16, bold=True)]
    headers = {"batch": "in turn", "model": "the model", "gradient": "each gives",
               "sum": "float32 sums"}
    for kind, (x, width) in columns.items():
        out.append(_text(x + width / 2, top - 12, headers[kind], anchor="middle",
                         fill=MUTED, bold=True))
    x, width = columns["model"]
    out.append(_box(x, top, width, bottom - top, "model"))
    middle = (top + bottom) / 2
    for line, text in enumerate(("forward and", "backward pass", "on one micro-",
                                 "batch at a time")):
        out.append(_text(x + width / 2, middle - 27 + 18 * line, text, anchor="middle"))
    x, width = columns["sum"]
    out.append(_box(x, top, width, bottom - top, "sum"))
    for i in range(1, steps + 1):
        y = top + (i - 1) * row
        centre = y + box / 2
        x, width = columns["batch"]
        out += [_box(x, y, width, box, "batch"),
                _text(x + width / 2, y + 20, f"micro-batch {i}", anchor="middle", bold=True),
                _text(x + width / 2, y + 38, "b samples", anchor="middle"),
                _arrow(x + width, centre, columns["model"][0], centre)]
        x, width = columns["gradient"]
        out += [_arrow(columns["model"][0] + columns["model"][1], centre, x, centre),
                _box(x, y, width, box, "gradient"),
                _text(x + 12, y + 20, f"gradient g_{i}"),
                _text(x + 12, y + 38, f"weight w_{i} = b"),
                _arrow(x + width, centre, columns["sum"][0], centre)]
        x, width = columns["sum"]
        add = "=" if i == 1 else "+="
        out += [_text(x + 14, y + 20, f"S {add} w_{i} · g_{i}"),
                _text(x + 14, y + 38, f"W {add} w_{i}")]
    # The close of the window (right) and the one update (left).
    x, width = columns["sum"]
    close_x = 400
    out += [_arrow(x + width / 2, bottom, x + width / 2, close_y),
            _box(close_x, close_y, 680 - close_x, 62, "sum"),
            _text(close_x + 14, close_y + 24, "the window closes:", bold=True),
            _text(close_x + 14, close_y + 46, "g = S / W, the weighted mean"),
            _arrow(close_x, close_y + 31, 372, close_y + 31),
            _box(20, close_y, 352, 62, "update"),
            _text(34, close_y + 24, "the optimizer makes ONE update", bold=True),
            _text(34, close_y + 46, f"equal to one step on all {steps} × b samples")]
    notes = ("w_i is the micro-batch's number of samples (or tokens): a shorter one",
             "counts for less. S and W are then emptied for the next window.")
    for line, text in enumerate(notes):
        out.append(_text(20, close_y + 62 + 30 + 20 * line, text, fill=MUTED))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
