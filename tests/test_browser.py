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

pytestmark = pytest.mark.kernel_independent("the built site in a browser: search, rendering, requests")

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
        context.set_default_timeout(60_000)  # a loaded 2-core machine: the search index alone took 4 s

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


# The calculator's two charts, drawn by docs/assets/js/calculator.js: the memory bar and the
# pipeline schedule. Layouts: (model, cluster, every form field). One fits, one does not, and
# pipelines: 1F1B, GPipe, interleaved, and m > 16 (the drawing stops at 16 micro-batches).
H100 = "H100 SXM, 8 per node, InfiniBand 400 Gb/s"
FORM_DEFAULTS = dict(dp=8, tp=1, pp=1, virtual_stages=1, cp=1, cp_overlap=True, sp=False, ep=1,
                     ep_overlap=False,
                     zero_stage=1, precision="bf16", recompute="none", micro_batch_size=1,
                     micro_batches=8, seq_len=2048, schedule="1f1b", mfu=0.4,
                     flops="matmuls+attention")
CHART_LAYOUTS = [
    ("llama-7b", H100, dict(dp=8, zero_stage=3)),  # fits, no pipeline
    ("llama-7b", H100, dict(dp=8, zero_stage=0)),  # 119 GB of 80: over capacity
    ("llama-70b", H100, dict(dp=16, tp=8, pp=4, micro_batches=8)),  # 1F1B
    ("small", "This course's 2-core CPU (gloo)",
     dict(dp=1, pp=2, micro_batches=4, seq_len=128, precision="fp32", schedule="gpipe")),
    ("llama-70b", H100, dict(dp=16, tp=8, pp=4, virtual_stages=4, micro_batches=16,
                             zero_stage=2, recompute="selective")),  # interleaved
    ("llama-70b", H100, dict(dp=8, tp=8, pp=8, micro_batches=40, sp=True,
                             seq_len=4096)),  # m = 40: 16 drawn
    # The 1000-GPU page's layout: TP 8 with SP x DP 128 fits in 80 GB here as in the Python
    # (tests/test_planner_published.py asserts the Python's side).
    ("llama-70b", H100, dict(dp=128, tp=8, micro_batches=8, seq_len=4096, sp=True)),
    # An MoE model with its experts split 8 ways and the all-to-alls overlapped.
    ("deepseek-v3", H100, dict(dp=64, ep=8, seq_len=4096, recompute="full", ep_overlap=True)),
]


def set_calculator_form(page, model, cluster, values):
    page.select_option("#planner-model", model)
    page.select_option("#planner-cluster", cluster)
    for key, value in values.items():
        selector = f"#planner-{key}"
        if isinstance(value, bool):
            page.set_checked(selector, value)
        elif key in ("zero_stage", "precision", "recompute", "schedule", "flops"):
            page.select_option(selector, str(value))
        else:
            page.fill(selector, str(value))


def check_calculator_charts(page, model, cluster, overrides):
    """The charts on the page against the Python planner for the same inputs."""
    from snippets.planner import cost_model
    from snippets.scratch.pipeline import SCHEDULES

    plan = {**FORM_DEFAULTS, **overrides}
    set_calculator_form(page, model, cluster, plan)
    expected = cost_model.plan_training(cost_model.MODELS[model], plan,
                                        cost_model.CLUSTERS[cluster])
    where = f"{model} {overrides}"

    # Memory bar: one rect per part, its bytes the Python's, its width in proportion.
    memory = expected["memory_bytes"]
    named = ("weights", "gradients", "optimizer", "activations")
    parts = {k: memory[k] for k in named}
    parts["other"] = memory["total"] - sum(memory[k] for k in named)
    bar = page.locator(".planner-memory svg")
    rects = bar.locator("rect[data-part]")
    got = {r.get_attribute("data-part"): (float(r.get_attribute("data-bytes")),
                                          float(r.get_attribute("width")))
           for r in rects.all()}
    assert set(got) == set(parts), where
    capacity = cost_model.CLUSTERS[cluster]["gpu_memory_gb"] * 1e9
    px_per_byte = float(bar.locator(".planner-mem-capacity").get_attribute("x1")) / capacity
    for key, value in parts.items():
        assert got[key][0] == pytest.approx(value, rel=1e-12, abs=1e-3), (where, key)
        assert got[key][1] == pytest.approx(value * px_per_byte, abs=0.02), (where, key)
    # Over capacity: flagged on the SVG, the excess hatched, the caption says so.
    over = not expected["fits"]
    assert bar.get_attribute("data-over-capacity") == str(over).lower(), where
    assert bar.locator(".planner-mem-over").count() == int(over), where
    caption = page.inner_text(".planner-memory figcaption")
    assert ("over capacity" in caption) == over, (where, caption)
    assert bar.locator("title").count() >= 1 and bar.get_attribute("role") == "img"
    # The table's times, as the page prints them (ms to 2 decimals, or s to 3).
    for key in ("expert_parallel", "step"):
        shown = page.inner_text(f"[data-out='{key}']").split(" (")[0]
        number, unit = shown.split()
        assert float(number) * (1e-3 if unit == "ms" else 1) == pytest.approx(
            expected["time_s"][key], abs=5e-6 if unit == "ms" else 5e-4), (where, key, shown)

    # Schedule: only with a pipeline.
    schedule = page.locator(".planner-schedule svg")
    p, v = plan["pp"], plan["virtual_stages"]
    if p == 1:
        assert schedule.count() == 0, where
        return
    m = int(schedule.get_attribute("data-micro-batches"))
    assert m == min(plan["micro_batches"], 16), where
    assert (m < plan["micro_batches"]) == ("micro-batches (at most 16" in
                                           page.inner_text(".planner-schedule figcaption"))
    ops = schedule.locator(".planner-pipe-op")
    assert ops.count() == 2 * m * p * v, where  # an F and a B per micro-batch, stage and chunk
    # Each rank's blocks, left to right, in the order of the course's schedule code.
    blocks = page.eval_on_selector_all(
        ".planner-schedule .planner-pipe-op",
        "gs => gs.map(g => { const r = g.querySelector('rect'); return [g.dataset.kind, "
        "+g.dataset.microBatch, +g.dataset.chunk, +r.getAttribute('y'), "
        "+r.getAttribute('x'), +r.getAttribute('width')]; })")
    rows = sorted({b[3] for b in blocks})
    assert len(rows) == p, where
    if v == 1:
        for stage, y in enumerate(rows):
            order = [(k, i) for k, i, _, row, _, _ in sorted(blocks, key=lambda b: b[4])
                     if row == y]
            assert order == SCHEDULES[plan["schedule"]](m, stage, p), (where, stage)
    else:  # interleaved: every rank runs each micro-batch's F and B once on each of its chunks
        for y in rows:
            ops_here = sorted((k, i, c) for k, i, c, row, _, _ in blocks if row == y)
            assert ops_here == sorted((k, i, c) for k in "FB" for i in range(m)
                                      for c in range(v)), where
    # The bubble: hatched rects (a pattern fill, not a colour), whose share of the rank-time
    # is the model's bubble for the m drawn.
    bubbles = page.eval_on_selector_all(
        ".planner-schedule .planner-pipe-bubble",
        "rs => rs.map(r => [r.getAttribute('fill'), +r.dataset.idle, +r.getAttribute('width')])")
    assert bubbles and all(fill.startswith("url(#") for fill, _, _ in bubbles), where
    assert schedule.locator("pattern").count() == 1
    drawn = cost_model.plan_training(cost_model.MODELS[model], {**plan, "micro_batches": m},
                                     cost_model.CLUSTERS[cluster])["bubble_fraction"]
    span = float(schedule.get_attribute("data-span"))
    assert sum(idle for _, idle, _ in bubbles) / (p * span) == pytest.approx(drawn, rel=1e-9)
    busy_px = sum(b[5] for b in blocks)
    idle_px = sum(w for _, _, w in bubbles)
    assert idle_px / (idle_px + busy_px) == pytest.approx(drawn, abs=2e-3), where  # 0.01 px
    if m == plan["micro_batches"]:
        assert drawn == pytest.approx(expected["bubble_fraction"], rel=1e-12)


def test_calculator_draws_memory_and_schedule_like_the_python(browser_page, site_url):
    from snippets.scratch.pipeline import SCHEDULES

    page, requests, errors = browser_page
    page.goto(site_url + "reference/calculator/")
    page.locator("#planner-calculator [data-out='step']").wait_for()
    # The page's schedule order is the course's (snippets/scratch/pipeline.py).
    for name in SCHEDULES:
        for p, m in [(2, 4), (4, 8), (4, 2), (8, 3)]:
            for stage in range(p):
                got = page.evaluate("a => PlannerCalculator.scheduleOrder(...a, 1)",
                                    [name, m, stage, p])
                assert [(k, i) for k, i, _ in got] == SCHEDULES[name](m, stage, p)
    for model, cluster, overrides in CHART_LAYOUTS:
        check_calculator_charts(page, model, cluster, overrides)
    assert not errors, f"JavaScript errors: {errors}"


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's JavaScript")
def test_calculator_schedule_order_is_the_course_schedule_code():
    """The order calculator.js draws equals snippets/scratch/pipeline.py's SCHEDULES (without a
    browser or a site build: the browser test above checks the drawn page)."""
    import json
    import subprocess
    from pathlib import Path

    from snippets.scratch.pipeline import SCHEDULES

    script = Path(__file__).parents[1] / "docs/assets/js/calculator.js"
    cases = [(name, m, stage, p) for name in SCHEDULES for p, m in [(2, 4), (4, 8), (4, 2), (8, 3)]
             for stage in range(p)]
    runner = (f"globalThis.window = {{}}; require({json.dumps(str(script))});\n"
              "const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));\n"
              "console.log(JSON.stringify(cases.map(a => "
              "window.PlannerCalculator.scheduleOrder(...a, 1))));\n")
    out = subprocess.run(["node", "-e", runner], input=json.dumps(cases), capture_output=True,
                         text=True, check=True).stdout
    for (name, m, stage, p), got in zip(cases, json.loads(out)):
        assert [(k, i) for k, i, _ in got] == SCHEDULES[name](m, stage, p), (name, m, stage, p)


# The two figures drawn from real runs (snippets/figures/memory_timeline.py, ddp_trace.py), on
# the pages that show them, at a desktop and a phone width.
MEASURED_FIGURES = {"workshop/session-a/slides/": "memory-timeline.svg",
                    "workshop/session-b/slides/": "ddp-trace.svg"}


def test_measured_figures_load_and_fit_desktop_and_phone(browser_page, site_url):
    page, requests, errors = browser_page
    try:
        for width in (1280, 390):
            page.set_viewport_size({"width": width, "height": 900})
            for path, name in MEASURED_FIGURES.items():
                page.goto(site_url + path)
                image = page.locator(f"article img[src$='assets/figures/{name}']")
                assert image.count() == 1, f"{path}: no <img> of {name}"
                image.scroll_into_view_if_needed()
                image.wait_for(state="visible")
                page.wait_for_function("el => el.complete", arg=image.element_handle())
                got = image.evaluate(
                    "el => { const r = el.getBoundingClientRect(); return {natural: "
                    "el.naturalWidth, width: r.width, height: r.height, left: r.left, "
                    "right: r.right, viewport: document.documentElement.clientWidth, "
                    "alt: el.getAttribute('alt')}; }")
                where = f"{name} at {width} px"
                assert got["natural"] > 0, f"{where}: the image did not load"
                assert got["width"] > 0 and got["height"] > 0, where
                assert got["left"] >= 0 and got["right"] <= got["viewport"] + 0.5, (
                    f"{where}: wider than the viewport ({got})")
                assert got["alt"] and len(got["alt"]) > 40, f"{where}: no text alternative"
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})
    assert not errors, f"JavaScript errors: {errors}"
    assert all(urlparse(u).hostname in LOOPBACK_HOSTS for u in requests
               if not u.startswith(("data:", "blob:")))
