"""The documentation site builds as users would read it: `mkdocs build --strict`
(every page in the nav, no broken reference, every docstring parsed), every internal
link of the built site leads to a page and an anchor that exist, the API reference
(one page per name or small group under api/) holds every public name of `gradaccum`
and none of its private modules, with signatures no wider than the code blocks, each
nav label is its page's title, and no page loads anything from outside the site (its
formulas render with the MathJax the build copies in). Where a Chromium is installed
(.ci/run installs Debian's), a real browser loads every page without a console error
or a missing file, and sees a formula and a tabbed block rendered. The site builds
with TensorFlow's Keras alone: JAX and PyTorch cannot be imported during the build
(the test command installs PyTorch only for PyTorch's run), and their pages still
hold their classes."""

from __future__ import annotations

import contextlib
import functools
import html
import html.parser
import http.server
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse

import pytest

import gradaccum
from gradaccum.core import options

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = sorted(set(gradaccum.__all__) - {"__version__"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("mkdocs", reason="the `docs` extra builds the site")
    out = tmp_path_factory.mktemp("site")
    absent = tmp_path_factory.mktemp("absent")
    for module in ("jax", "torch"):
        (absent / f"{module}.py").write_text(f"raise ImportError('no {module} here')\n")
    path = os.pathsep.join(filter(None, [str(absent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", KERAS_BACKEND="tensorflow",
               PYTHONPATH=path)
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                            "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=600, env=env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-5000:]
    return out


class _Page(html.parser.HTMLParser):
    """A built page's ids and the links and sources it points to."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name):
                self.links.append(attrs[name])


def _parsed(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


def test_every_internal_link_of_the_built_site_resolves(site):
    pages = {path: _parsed(path) for path in site.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urllib.parse.urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            if not parts.path:
                target = path
            elif parts.path.startswith("/"):
                # (The 404 page links from the site's root: it is served anywhere.)
                target = (site / urllib.parse.unquote(parts.path).lstrip("/")).resolve()
            else:
                target = (path.parent / urllib.parse.unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)} -> {link}")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parsed(target).ids
                if parts.fragment not in ids:
                    broken.append(f"{path.relative_to(site)} -> {link} (no such anchor)")
    assert not broken, "\n".join(broken[:40])
    assert len(pages) >= 20


def _api_pages(site) -> dict[pathlib.Path, str]:
    return {path: path.read_text() for path in sorted((site / "api").rglob("index.html"))}


def test_the_api_reference_holds_every_public_name_and_no_private_module(site):
    pages = _api_pages(site)
    assert len(pages) >= 10, "the API reference is one page per name or small group"
    ids = {path: _parsed(path).ids for path in pages}
    every = set().union(*ids.values())
    for name in PUBLIC:
        assert f"gradaccum.{name}" in every, name
    for backend in ("jax", "torch"):
        assert f"gradaccum.backends.{backend}.accumulator.GradientAccumulator" in every
    # Rendered from the docstrings, the `{options}` lines of `accumulate` and `wrap`
    # filled with every option (docs/griffe_options.py, as `options.takes_options`
    # does at import).
    assert not [path for path, text in pages.items() if "{options}" in text]
    for door, after in (("accumulate", "disable"), ("wrap", "AccumulatingModel")):
        text = next(text for path, text in pages.items()
                    if f'id="gradaccum.{door}"' in text)
        section = text[text.index(f'id="gradaccum.{door}"'):
                       text.index(f'id="gradaccum.{after}"')]
        missing = [name for name in options.NAMES if f"<code>{name}</code>" not in section]
        assert not missing, (door, missing)
    private = [i for i in every if i.startswith("gradaccum.") and any(
        part.startswith("_") and not part.startswith("__") for part in i.split("."))]
    assert not private, private


def test_each_backends_accumulator_has_a_page_and_a_table_of_contents_entry_of_its_own(
        site):
    titles = {}
    for backend, name in (("tensorflow", "TensorFlow"), ("jax", "JAX"),
                          ("pytorch", "PyTorch")):
        text = (site / "api" / f"gradient-accumulator-{backend}" / "index.html").read_text()
        titles[backend] = re.search(r"<title>(.*?)</title>", text).group(1)
        toc = text[text.index('data-md-component="toc"'):]
        assert f"GradientAccumulator ({name})" in toc, backend
    assert len(set(titles.values())) == 3, titles


def test_the_api_reference_shows_no_code_line_over_88_characters(site):
    """Signatures are formatted (ruff or black, by mkdocstrings) to 88 characters, and
    the docstrings' examples are written to that width."""
    wide = []
    for path, text in _api_pages(site).items():
        for block in re.findall(r"<pre[^>]*>(.*?)</pre>", text, flags=re.S):
            for line in html.unescape(re.sub(r"<[^>]+>", "", block)).splitlines():
                if len(line) > 88:
                    wide.append(f"{path.relative_to(site)}: {line}")
    assert not wide, "\n".join(wide)


def _nav(entries):
    for entry in entries:
        for label, target in entry.items():
            if isinstance(target, list):
                yield from _nav(target)
            else:
                yield label, target


def _title(page: pathlib.Path) -> str:
    text = page.read_text()
    included = re.match(r'--8<-- "([^"]+)"', text)
    if included:  # a page that is another file of the repository (BENCHMARKS.md)
        text = (ROOT / included.group(1)).read_text()
    return next(line[2:].strip() for line in text.splitlines() if line.startswith("# "))


def test_each_nav_label_is_its_pages_title():
    """What the navigation calls a page is what the page calls itself (its `# `
    heading, code spans written plainly)."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    differ = [f"{target}: nav {label!r}, title {_title(ROOT / 'docs' / target)!r}"
              for label, target in _nav(config["nav"])
              if _title(ROOT / "docs" / target).replace("`", "") != label]
    assert not differ, "\n".join(differ)


def _assets(path: pathlib.Path) -> list[str]:
    """What a built page loads: its scripts, stylesheets, images and frames."""
    class Loads(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.loads = []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag in ("script", "img", "iframe", "source", "video", "audio") and (
                    attrs.get("src")):
                self.loads.append(attrs["src"])
            if tag == "link" and attrs.get("href") and set(
                    (attrs.get("rel") or "").split()) & {"stylesheet", "preload",
                                                         "modulepreload", "icon"}:
                self.loads.append(attrs["href"])

    parser = Loads()
    parser.feed(path.read_text(errors="replace"))
    return parser.loads


def test_no_page_loads_anything_from_outside_and_formulas_use_the_shipped_mathjax(site):
    outside = [f"{path.relative_to(site)}: {src}" for path in sorted(site.rglob("*.html"))
               for src in _assets(path) if urllib.parse.urlsplit(src).netloc
               or src.startswith("//")]
    assert not outside, "\n".join(outside[:20])
    with_maths = [path for path in sorted(site.rglob("*.html"))
                  if 'class="arithmatex"' in path.read_text()]
    assert with_maths, "no page of the site has a formula"
    for path in with_maths:
        scripts = [(path.parent / src).resolve() for src in _assets(path)
                   if src.endswith("tex-chtml-full.js")]
        assert scripts and all(script.is_file() for script in scripts), path
    fonts = site / "assets" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert len(list(fonts.glob("*.woff"))) >= 20
    assert (site / "assets" / "mathjax" / "LICENSE").is_file()


def test_the_performance_page_shows_the_figures_drawn_from_the_record(site):
    for name in ("throughput.png", "memory.png", "gpu.png", "backends.png"):
        figure = site / "figures" / name
        assert figure.exists() and figure.stat().st_size > 10_000, name
    text = (site / "performance" / "index.html").read_text()
    for name in ("throughput", "memory", "gpu", "backends"):
        assert f"figures/{name}.png" in text, name


def _browser():
    """A Chromium's command; None where there is none, or a failure where one is
    required (GRADACCUM_REQUIRE_BROWSER, which .ci/run sets after installing it)."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("GRADACCUM_REQUIRE_BROWSER"):
        pytest.fail("no Chromium installed, and GRADACCUM_REQUIRE_BROWSER wants one "
                    "(Debian: apt-get install --no-install-recommends chromium)")
    return None


@contextlib.contextmanager
def _serving(directory: pathlib.Path):
    """`directory` over HTTP on a free local port, as a user's server gives it (the
    search runs in a worker, which a file:// page may not start): its address, and
    the list of what it was asked for and could not give."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def log_request(self, code="-", size="-"):
            if not str(code).startswith(("2", "3")):  # 304: a cached file, served
                missing.append(f"{code} {self.path}")

    missing = []
    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", missing
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP (`_serving`)."""
    with _serving(site) as found:
        yield found


# One page that opens each of `PAGES` in turn in a frame of a desktop's size, gives it
# `WAIT` ms of its timers (MathJax typesets, the theme sets up its tabs), and writes
# what the frame's document holds into its own: one Chromium for every page.
_HARNESS = """<!doctype html><html><head><link rel="icon" href="data:,"></head>
<body><pre id="found"></pre>
<iframe id="frame" width="1280" height="900"></iframe>
<script>
const PAGES = %(pages)s, WAIT = %(wait)d, found = [];
const frame = document.getElementById("frame");
function next(index) {
  if (index === PAGES.length) {
    document.getElementById("found").textContent = JSON.stringify(found);
    return;
  }
  frame.onload = () => setTimeout(() => {
    const page = frame.contentDocument;
    found.push({
      page: PAGES[index],
      content: page.querySelector(".md-content") !== null,
      formulas: page.querySelectorAll(".arithmatex").length,
      typeset: page.querySelectorAll("mjx-container").length,
      tabs: page.querySelectorAll(".tabbed-set").length,
      set_up: page.querySelector(".tabbed-labels") !== null
        && page.querySelector(".tabbed-control") !== null,
    });
    next(index + 1);
  }, WAIT);
  frame.src = PAGES[index];
}
next(0);
</script></body></html>
"""


def _opened_in_one_browser(browser, address, folder, pages, wait=3000):
    """Every page of `pages` (paths under `address`, served from `folder`) in one
    headless Chromium (`_HARNESS`): what each frame held, and every line a page wrote
    to its console (Chromium logs each, whatever its level and frame, as a CONSOLE
    line). Chromium's virtual time runs the pages' timers without waiting for them."""
    harness = folder / "_every_page.htm"  # not *.html: no page of the site
    harness.write_text(_HARNESS % {"pages": json.dumps(pages), "wait": wait})
    try:
        budget = (len(pages) + 1) * (wait + 1000)
        dumped = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu",
             "--enable-logging=stderr", "--v=0", f"--virtual-time-budget={budget}",
             "--dump-dom", address + harness.name],
            capture_output=True, text=True, timeout=600)
    finally:
        harness.unlink()
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    console = [line for line in dumped.stderr.splitlines() if ":CONSOLE" in line]
    found = re.search(r'<pre id="found">(.*?)</pre>', dumped.stdout, flags=re.S)
    assert found and found.group(1), "the harness did not finish: " + dumped.stdout[-2000:]
    return json.loads(html.unescape(found.group(1))), console


def _opened(browser, url, shot=None):
    """Headless Chromium on `url`: its DOM after the scripts ran (3 s of the page's
    timers given, so what a script does late is seen too), and every line the page
    wrote to its console (Chromium logs each one, whatever its level, as a CONSOLE
    line); with `shot`, a screenshot there too."""
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu",
              "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000"]
    dumped = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                            timeout=120)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    console = [line for line in dumped.stderr.splitlines() if ":CONSOLE" in line]
    if shot is not None:
        captured = subprocess.run([*common, f"--screenshot={shot}",
                                   "--window-size=1280,900", url],
                                  capture_output=True, text=True, timeout=120)
        assert captured.returncode == 0 and shot.exists(), captured.stderr[-2000:]
    return dumped.stdout, console


def test_the_browser_check_sees_what_a_page_writes_to_its_console(tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt install chromium)")
    page = tmp_path / "broken.html"
    page.write_text("<html><body>x<script>console.error('boom'); "
                    "setTimeout(() => console.error('late'), 300); missing();</script>"
                    "</body></html>")
    _, console = _opened(browser, page.as_uri(), tmp_path / "broken.png")
    assert any("boom" in line for line in console), console
    assert any("late" in line for line in console), console
    assert any("Uncaught ReferenceError" in line for line in console), console
    # The same through the page that opens every page in one browser, after a good
    # page, with a file the page asks for and the server does not have.
    (tmp_path / "good.html").write_text('<html><body><div class="md-content">ok</div>'
                                        '<img src="absent.png"></body></html>')
    with _serving(tmp_path) as (address, missing):
        found, console = _opened_in_one_browser(browser, address, tmp_path,
                                                ["good.html", "broken.html"], wait=500)
    assert [(f["page"], f["content"]) for f in found] == [("good.html", True),
                                                         ("broken.html", False)]
    assert any("boom" in line for line in console), console
    assert any("late" in line for line in console), console
    assert any("Uncaught ReferenceError" in line for line in console), console
    # (A page without an icon of its own has Chromium ask for /favicon.ico.)
    assert [m for m in missing if "favicon" not in m] == ["404 /absent.png"], missing


def test_a_real_browser_loads_every_page_without_a_console_error_or_a_missing_file(
        site, served, tmp_path):
    """Every page of the built site, in headless Chromium: nothing written to the
    console, nothing asked of the server that it does not have (an image, a script, a
    font), the page's content there; formulas typeset by MathJax (its `mjx-container`
    elements) and tabbed blocks set up by the theme's script."""
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt install chromium)")
    address, missing = served
    pages = sorted(path.relative_to(site).as_posix() for path in site.rglob("*.html"))
    assert len(pages) >= 20
    found, console = _opened_in_one_browser(browser, address, site, pages)
    assert [f["page"] for f in found] == pages
    failed = [f"console: {line}" for line in console]
    failed += [f"not served: {asked}" for asked in missing]
    missing.clear()
    for f in found:
        if not f["content"]:
            failed.append(f"{f['page']}: no content")
        if f["formulas"] and not f["typeset"]:
            failed.append(f"{f['page']}: a formula not typeset")
        if f["tabs"] and not f["set_up"]:
            failed.append(f"{f['page']}: a tabbed block not set up")
    assert not failed, "\n".join(failed)
    assert sum(f["formulas"] > 0 for f in found) and sum(f["tabs"] > 0 for f in found)


@pytest.mark.parametrize("page", ["", "guides/fit/", "api/"])
def test_a_page_looks_like_a_page(served, page, tmp_path):
    # Screenshots kept where GRADACCUM_SCREENSHOTS names a folder (to look at them).
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt install chromium)")
    folder = pathlib.Path(os.environ.get("GRADACCUM_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    shot = folder / ((page.strip("/").replace("/", "-") or "index") + ".png")
    dom, _ = _opened(browser, served[0] + page, shot)
    assert "</html>" in dom and 'class="md-content"' in dom
    assert shot.stat().st_size > 20_000, "a blank screenshot"
