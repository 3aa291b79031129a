"""The house of gradaccum, read from its code: each module's imports of the package,
the floor each module stands on, and what breaks the plan (an import circle, an
import that climbs to a higher floor, a module over 600 lines, a class over 300
lines of code).

    python scripts/house.py            the floors and their modules, and any fault
    python scripts/house.py --check    exits 1 on a fault (the test suite runs it)
    python scripts/house.py --svg F    also draws the floors into F (the docs build
                                       does, for docs/architecture.md)

Every import counts: at the top of a module, inside a function (lazy), under
`TYPE_CHECKING`, and `importlib.import_module` or `__import__` of a name written out.
A module name computed at run time (the package's lazy exports, `_backend`'s table
of adapters, both on the top floor) cannot be read. Only the standard library is
used, so it runs before set-up.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gradaccum"

# Bottom to top: a module may import its own floor and the floors below it.
FLOORS = (
    ("core", "what accumulation is, with no backend: options, the window's state and "
     "transitions, the math (keras.ops and NumPy only)",
     ("gradaccum.core",)),
    ("Keras's fit", "what every backend's fit shares: Keras's private pieces, the loss "
     "normalizers, exact epochs, the epoch hook, added losses, the saved state's keys; "
     "whether TensorFlow is installed",
     ("gradaccum._tf", "gradaccum._keras_common", "gradaccum.weighting", "gradaccum.exact_epochs",
      "gradaccum.epochs", "gradaccum.added_losses", "gradaccum.saving")),
    ("the adapter", "what a backend writes, declared in one module, and what every "
     "backend's adapter does alike",
     ("gradaccum.backend_interface", "gradaccum.adapter")),
    ("backends", "where the state lives and how gradients come, one folder per backend",
     ("gradaccum.backends",)),
    ("files", "the weights and the window saved as one pair, in Keras's files",
     ("gradaccum.state_file", "gradaccum.model_file")),
    ("the public API", "what users call: accumulate, wrap, audit, privacy_spent, "
     "load_model, the command line and the seed experiment",
     ("gradaccum.attach", "gradaccum.keras_model", "gradaccum.auditing",
      "gradaccum.privacy", "gradaccum._backend", "gradaccum.cli",
      "gradaccum.__main__", "gradaccum.experiments", "gradaccum")),
)


def modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of `package`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _owner(name: str, known) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (each `from x import y` counts as
    `x.y` where that is a module, else `x`)."""
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = here
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known
                           else base for alias in node.names]
            elif (isinstance(node, ast.Call) and node.args
                  and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and (getattr(node.func, "attr", None) == "import_module"
                       or getattr(node.func, "id", None) in ("import_module",
                                                             "__import__"))):
                # importlib.import_module("gradaccum.x"), __import__("gradaccum.x")
                targets = [node.args[0].value]
            for target in targets:
                owner = _owner(target, known)
                if owner is not None and owner != name:
                    edges[name].add(owner)
    return edges


def floor_of(name: str) -> int:
    """The index in `FLOORS` of the floor `name` stands on (the longest prefix)."""
    best, length = None, -1
    for index, (_, _, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    if best is None:
        raise ValueError(f"module {name} stands on no floor: add it to FLOORS")
    return best


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(1000, 10 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def climbs(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a module on a higher floor than the importer's; the package's
    `__init__` (which every submodule's import runs) is not counted as a target."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if b != "gradaccum" and floor_of(b) > floor_of(a))


# Sizes a reader can hold.
MODULE_LINES = 600
CLASS_CODE_LINES = 300


def code_lines(source: str, node: ast.AST) -> int:
    """Lines of `node` that hold code: not blank, not a comment, not a docstring."""
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if (isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = source.splitlines()[node.lineno - 1:node.end_lineno]
    return sum(1 for number, line in enumerate(lines, start=node.lineno)
               if line.strip() and not line.strip().startswith("#")
               and number not in docstrings)


def oversized(known: dict[str, pathlib.Path]) -> list[str]:
    """Modules over `MODULE_LINES` lines and classes over `CLASS_CODE_LINES` lines
    of code."""
    found = []
    for name, path in known.items():
        source = path.read_text()
        if len(source.splitlines()) > MODULE_LINES:
            found.append(f"too long: {name} has {len(source.splitlines())} lines "
                         f"(at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                count = code_lines(source, node)
                if count > CLASS_CODE_LINES:
                    found.append(f"too long: class {name}.{node.name} has {count} lines "
                                 f"of code (at most {CLASS_CODE_LINES})")
    return found


def faults(package: pathlib.Path = PACKAGE) -> list[str]:
    known = modules(package)
    edges = imports(known)
    lines = [f"import circle: {' <-> '.join(group)}" for group in circles(edges)]
    lines += [f"climbs: {a} ({FLOORS[floor_of(a)][0]}) imports {b} "
              f"({FLOORS[floor_of(b)][0]})" for a, b in climbs(edges)]
    return lines + oversized(known)


def script_circles(folder: pathlib.Path) -> list[list[str]]:
    """The import circles among a folder of scripts that import each other by their
    file names (`benchmarks/`: `import cells`)."""
    names = {path.stem: path for path in folder.glob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            edges[name] |= {t for t in targets if t in names and t != name}
    return circles(edges)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _wrapped(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])


def _room(name: str, floor: int) -> str:
    """A module's name as its floor's drawing shows it (the floor's prefix left out
    where it is the floor's one folder)."""
    prefixes = FLOORS[floor][2]
    short = name.removeprefix("gradaccum.")
    if len(prefixes) == 1 and prefixes[0] != "gradaccum" and name != prefixes[0]:
        short = name.removeprefix(prefixes[0] + ".")
    return "__init__" if name == "gradaccum" else short


def svg(package: pathlib.Path = PACKAGE) -> str:
    """The floors as an SVG picture: bottom to top, each with what it holds and its
    modules (a backend's folder one line per backend), the imports between floors
    counted on the arrows' side."""
    known = modules(package)
    edges = imports(known)
    # Drawn at the width of the site's content column (about 700 px), so its text
    # shows at 9 pt or more (12 px and up) there.
    width, pad, line_height, font = 700, 14, 17, 13
    blocks = []
    for index in reversed(range(len(FLOORS))):
        title, what, _ = FLOORS[index]
        names = sorted(n for n in known if floor_of(n) == index)
        lines = sum(len(known[n].read_text().splitlines()) for n in names)
        rooms: dict[str, list[str]] = {}
        for name in names:
            if known[name].name == "__init__.py" and name != "gradaccum":
                continue  # a folder: its modules stand for it
            room = _room(name, index)
            folder, _, leaf = room.rpartition(".")
            if index == 3 and folder:  # backends: one line per backend
                rooms.setdefault(folder.split(".")[0], []).append(leaf or folder)
            else:
                rooms.setdefault("", []).append(room)
        text = [(f"{index}. {title}", "bold"),
                *[(line, "what") for line in _wrapped(
                    f"{what} ({len(names)} modules, {lines} lines)", 92)]]
        for folder, leaves in rooms.items():
            label = f"{folder}/: " if folder else ""
            text += [(line, "rooms") for line in _wrapped(
                label + ", ".join(sorted(set(leaves))), 86)]
        down = sorted({FLOORS[floor_of(b)][0] for a in names for b in edges[a]
                       if b != "gradaccum" and floor_of(b) < index})
        if down:
            text.append(("imports: " + ", ".join(down), "imports"))
        blocks.append((index, text))
    height = sum(len(text) * line_height + 2 * pad + 10 for _, text in blocks) + 20
    colours = ("#dbeafe", "#e0e7ff", "#fef3c7", "#dcfce7", "#fae8ff", "#fee2e2")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" '
           f'font-size="{font}">',
           "<title>gradaccum's floors, drawn from its imports by scripts/house.py</title>"]
    y = 10
    for index, text in blocks:
        box = len(text) * line_height + 2 * pad
        out.append(f'<rect x="10" y="{y}" width="{width - 20}" height="{box}" rx="8" '
                   f'fill="{colours[index % len(colours)]}" stroke="#334155"/>')
        for row, (line, kind) in enumerate(text):
            style = {"bold": ' font-weight="bold" font-size="15"',
                     "what": ' fill="#1e293b"',
                     "rooms": ' font-family="Menlo, Consolas, monospace" font-size="12"',
                     "imports": ' fill="#475569" font-style="italic"'}[kind]
            out.append(f'<text x="24" y="{y + pad + (row + 1) * line_height - 4}"{style}>'
                       f"{_escape(line)}</text>")
        y += box + 10
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a fault")
    parser.add_argument("--svg", type=pathlib.Path, help="draw the floors into this file")
    args = parser.parse_args(argv)
    if args.svg is not None:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        args.svg.write_text(svg())
    known = modules()
    for index in reversed(range(len(FLOORS))):
        title, what, _ = FLOORS[index]
        names = sorted(n for n in known if floor_of(n) == index)
        lines = sum(len(known[n].read_text().splitlines()) for n in names)
        print(f"{index}. {title}: {what} ({len(names)} modules, {lines} lines)")
    found = faults()
    found += [f"import circle in benchmarks/: {' <-> '.join(group)}"
              for group in script_circles(ROOT / "benchmarks")]
    for line in found:
        print(line)
    if not found:
        print("No import circle; no import climbs a floor; no module or class too long.")
    return 1 if (found and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
