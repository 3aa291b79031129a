"""The documentation site builds as users would read it: `mkdocs build --strict`
(every page in the nav, no broken reference, every docstring parsed), every internal
link of the built site leads to a page and an anchor that exist, the API reference
holds every public name of `gradaccum` and none of its private modules, and, where
a Chromium is installed, a real browser loads the home page, a guide and the API
page without a console error. The site builds with TensorFlow's Keras alone: JAX and
PyTorch cannot be imported during the build (the test command installs PyTorch only
for PyTorch's run), and their pages still hold their classes."""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import pathlib
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


def test_the_api_reference_holds_every_public_name_and_no_private_module(site):
    page = _parsed(site / "api" / "index.html")
    for name in PUBLIC:
        assert f"gradaccum.{name}" in page.ids, name
    for backend in ("jax", "torch"):
        assert f"gradaccum.backends.{backend}.accumulator.GradientAccumulator" in page.ids
    text = (site / "api" / "index.html").read_text()
    # Rendered from the docstrings, the doors' `{options}` lines filled with every
    # option (docs/griffe_options.py, as `options.takes_options` does at import).
    assert "{options}" not in text
    for door, after in (("accumulate", "disable"), ("wrap", "AccumulatingModel")):
        section = text[text.index(f'id="gradaccum.{door}"'):
                       text.index(f'id="gradaccum.{after}"')]
        missing = [name for name in options.NAMES if f"<code>{name}</code>" not in section]
        assert not missing, (door, missing)
    private = [i for i in page.ids if i.startswith("gradaccum.") and any(
        part.startswith("_") and not part.startswith("__") for part in i.split("."))]
    assert not private, private


def test_the_performance_page_shows_the_figures_drawn_from_the_record(site):
    for name in ("throughput.png", "memory.png", "gpu.png", "backends.png"):
        figure = site / "figures" / name
        assert figure.exists() and figure.stat().st_size > 10_000, name
    text = (site / "performance" / "index.html").read_text()
    for name in ("throughput", "memory", "gpu", "backends"):
        assert f"figures/{name}.png" in text, name


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on a free local port, as a user's server gives it
    (the search runs in a worker, which a file:// page may not start)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def _opened(browser, url, shot):
    """Headless Chromium on `url`: its DOM after the scripts ran (3 s of the page's
    timers given, so what a script does late is seen too), every line the page
    wrote to its console (Chromium logs each one, whatever its level, as a CONSOLE
    line), and a screenshot at `shot`."""
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu",
              "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000"]
    dumped = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                            timeout=120)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    console = [line for line in dumped.stderr.splitlines() if ":CONSOLE" in line]
    captured = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,900",
                               url], capture_output=True, text=True, timeout=120)
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


@pytest.mark.parametrize("page", ["", "guides/fit/", "api/"])
def test_a_real_browser_loads_the_page_without_console_errors(served, page, tmp_path):
    # Screenshots kept where GRADACCUM_SCREENSHOTS names a folder (to look at them).
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt install chromium)")
    folder = pathlib.Path(os.environ.get("GRADACCUM_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    shot = folder / ((page.strip("/").replace("/", "-") or "index") + ".png")
    dom, console = _opened(browser, served + page, shot)
    assert "</html>" in dom and 'class="md-content"' in dom
    # A clean page writes nothing to its console.
    assert not console, console
    if page.startswith("api"):
        assert 'id="gradaccum.accumulate"' in dom
        assert "gradaccum.backends.torch.accumulator.GradientAccumulator" in dom
    assert shot.stat().st_size > 20_000, "a blank screenshot"
