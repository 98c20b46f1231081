"""Drive the built site in headless Chromium: search works, math and diagrams render, and no
request leaves the loopback interface.

Uses the system Chromium (/usr/bin/chromium) through the Python `playwright` package; Playwright's
own browser download is never used. Without Chromium the test skips with the reason, unless
REQUIRE_BROWSER=1 (set by .ci/run), where it fails.
"""

import functools
import http.server
import os
import shutil
import threading
from urllib.parse import urlparse

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LOOPBACK_HOSTS = {"127.0.0.1", "localhost"}


def require_browser():
    missing = None
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        missing = f"Chromium not found at {CHROMIUM} (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "the playwright Python package is not installed"
    if missing:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)


@pytest.fixture(scope="module")
def site_url(built_site):
    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(QuietHandler, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser_page(site_url):
    require_browser()
    from playwright.sync_api import sync_playwright

    requests = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(20_000)

        def record(route, request):
            requests.append(request.url)
            host = urlparse(request.url).hostname
            if request.url.startswith(("data:", "blob:")) or host in LOOPBACK_HOSTS:
                route.continue_()
            else:
                route.abort()  # recorded above; the assertion at the end names it

        context.route("**/*", record)
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page, requests, errors
        context.close()
        browser.close()


def visible_text_without_math(page, selector="article"):
    """The text a reader sees, with rendered math and code removed."""
    return page.eval_on_selector(
        selector,
        """el => { const c = el.cloneNode(true);
                   c.querySelectorAll('.katex, pre, code, script, style').forEach(n => n.remove());
                   return c.textContent; }""",
    )


def test_search_math_diagrams_and_no_outside_requests(browser_page, site_url, tmp_path):
    page, requests, errors = browser_page

    # Search: Material's client-side index (search/search_index.json), queried in a web worker.
    page.goto(site_url)
    page.locator("label.md-search__icon, .md-search__input").first.click()
    page.keyboard.type("gloo")  # Material searches on key events; fill() sends none
    results = page.locator(".md-search-result__item")
    results.first.wait_for()
    assert results.count() >= 1
    assert "gloo" in page.locator(".md-search-result").inner_text().lower()
    page.keyboard.press("Escape")

    # Math in a Markdown page (arithmatex + KaTeX).
    page.goto(site_url + "workshop/session-a/")
    page.locator("article .arithmatex .katex").first.wait_for()
    assert page.locator("article .arithmatex").count() == page.locator(
        "article .arithmatex .katex").count(), "some math was left untypeset"
    text = visible_text_without_math(page)
    for raw in ("\\[", "\\(", "$$"):
        assert raw not in text, f"raw TeX delimiter {raw!r} on the page"

    # Math in an executed lesson (notebook markdown cells keep $ and $$).
    page.goto(site_url + "lessons/memory_arithmetic/")
    page.locator("article .katex").first.wait_for()
    text = visible_text_without_math(page)
    assert "$$" not in text and "\\text{" not in text, "raw TeX left in the executed lesson"
    assert "16.0 bytes/param" in page.locator("article").inner_text()
    assert page.locator("article img[src^='data:image/png']").count() >= 1

    # A Mermaid diagram, drawn by the shipped mermaid.min.js (Material swaps the <pre> for a host).
    page.goto(site_url + "testing/")
    diagram = page.locator("article div.mermaid").first
    diagram.wait_for()
    assert page.locator("article pre.mermaid").count() == 0
    assert diagram.bounding_box()["height"] > 50
    page.screenshot(path=str(tmp_path / "testing-page.png"), full_page=True)
    print(f"screenshot: {tmp_path / 'testing-page.png'}")

    outside = sorted({u for u in requests if not u.startswith(("data:", "blob:"))
                      and urlparse(u).hostname not in LOOPBACK_HOSTS})
    assert not outside, "requests to non-loopback hosts:\n" + "\n".join(outside)
    assert len(requests) > 10  # the recorder saw the site's own requests
    assert not errors, f"JavaScript errors: {errors}"
