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


# Sample configurations for the calculator: (model, cluster, plan overrides).
CALCULATOR_SAMPLES = [
    ("tiny", "This course's 2-core CPU (gloo)", dict(dp=2, precision="fp32", seq_len=64)),
    ("small", "This course's 2-core CPU (gloo)", dict(dp=1, pp=2, micro_batches=4, seq_len=128,
                                                      precision="fp32", schedule="gpipe")),
    ("llama-7b", "H100 SXM, 8 per node, InfiniBand 400 Gb/s", dict(dp=8, zero_stage=3)),
    ("llama-13b", "A100 SXM 80GB, 8 per node, InfiniBand 200 Gb/s",
     dict(dp=4, tp=2, zero_stage=2, recompute=True)),
    ("llama-70b", "H100 SXM, 8 per node, InfiniBand 400 Gb/s",
     dict(dp=16, tp=8, pp=4, zero_stage=1, micro_batches=16)),
    ("llama-405b", "H100 SXM, 8 per node, InfiniBand 400 Gb/s",
     dict(dp=8, tp=8, pp=9, zero_stage=1, micro_batches=32, precision="fp8", recompute=True)),
]


def calculator_plan(**overrides):
    base = dict(dp=1, tp=1, pp=1, zero_stage=0, precision="bf16", recompute=False,
                micro_batch_size=1, micro_batches=8, seq_len=2048, schedule="1f1b", mfu=0.4)
    return {**base, **overrides}


def assert_same_numbers(js, py, path="result"):
    if isinstance(py, dict):
        assert set(js) == set(py), path
        for key in py:
            assert_same_numbers(js[key], py[key], f"{path}.{key}")
    elif isinstance(py, bool):
        assert js is py, path
    else:  # the same double-precision arithmetic in the same order: equal to rounding
        assert js == pytest.approx(py, rel=1e-12, abs=1e-300), path


def test_calculator_runs_the_python_cost_model_offline(browser_page, site_url):
    from snippets.planner import cost_model

    page, requests, errors = browser_page
    page.goto(site_url + "reference/calculator/")
    page.locator("#planner-calculator [data-out='step']").wait_for()
    for model, cluster, overrides in CALCULATOR_SAMPLES:
        plan = calculator_plan(**overrides)
        expected = cost_model.plan_training(cost_model.MODELS[model], plan,
                                            cost_model.CLUSTERS[cluster])
        got = page.evaluate(
            "([m, p, c]) => PlannerModel.plan_training(PlannerModel.MODELS[m], p, "
            "PlannerModel.CLUSTERS[c])", [model, plan, cluster])
        assert_same_numbers(got, expected, f"{model} {overrides}")

    # The form: 70B with 3 pipeline stages is refused with the model's own message ...
    page.select_option("#planner-model", "llama-70b")
    page.fill("#planner-pp", "3")
    page.locator("[data-out='error']").wait_for()
    assert "num_hidden_layers=80 does not divide into pp=3" in page.inner_text("[data-out='error']")
    # ... and a valid layout shows the Python's numbers.
    for key, value in dict(dp=16, tp=8, pp=4, micro_batches=16).items():
        page.fill(f"#planner-{key}", str(value))
    page.select_option("#planner-zero_stage", "1")
    expected = cost_model.plan_training(
        cost_model.MODELS["llama-70b"], calculator_plan(dp=16, tp=8, pp=4, zero_stage=1,
                                                        micro_batches=16),
        cost_model.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"])
    assert page.inner_text("[data-out='gpus']") == "512"
    assert page.inner_text("[data-out='memory']") == f"{expected['memory_bytes']['total'] / 1e9:.2f} GB"
    assert page.inner_text("[data-out='tokens_per_s']") == f"{round(expected['tokens_per_s']):,}"
    assert page.inner_text("[data-out='fits']").startswith("yes")
    assert not errors, f"JavaScript errors: {errors}"
    assert all(urlparse(u).hostname in LOOPBACK_HOSTS for u in requests
               if not u.startswith(("data:", "blob:")))
