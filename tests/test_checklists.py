"""The study plan's checklists in headless Chromium: a tick survives a reload and an instant-
navigation page change (docs/assets/js/checklists.js, state in localStorage).

Same browser set-up as tests/test_browser.py: the system Chromium, skipped with the reason when it
is missing, unless REQUIRE_BROWSER=1.
"""

import pytest

from tests.test_browser import CHROMIUM, CHROMIUM_FLAGS, require_browser, site_url  # noqa: F401

pytestmark = pytest.mark.kernel_independent("the study plan's tick boxes in a browser")

PAGE = "reference/study-plan/"


@pytest.fixture(scope="module")
def page(site_url):  # noqa: F811
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        context = browser.new_context()
        context.set_default_timeout(60_000)  # generous: a loaded 2-core machine
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page, errors
        context.close()
        browser.close()


def boxes(page):
    return page.locator("article .task-list-item input[type=checkbox]")


def test_a_tick_persists_across_reload_and_instant_navigation(page, site_url):  # noqa: F811
    page, errors = page
    page.goto(site_url + PAGE)
    assert page.locator("script[src*='checklists.js']").count() == 1, (
        "checklists.js is not loaded: add `- assets/js/checklists.js` to extra_javascript in "
        "mkdocs.yml")
    first, second = boxes(page).nth(0), boxes(page).nth(1)
    assert boxes(page).count() > 10
    assert first.is_enabled() and not first.is_checked()  # the script enabled the boxes
    progress = page.locator("article [data-checklist-progress]").first
    total = boxes(page).count()
    assert progress.inner_text() == f"0 of {total} ticked"

    # A reader clicks the box Material draws (a ::before of an empty span, so Playwright sees
    # no size to click); the click reaches the label, which toggles its hidden input.
    page.locator("article .task-list-item label").first.dispatch_event("click")
    assert first.is_checked() and not second.is_checked()
    assert progress.inner_text() == f"1 of {total} ticked"

    page.reload()
    assert boxes(page).nth(0).is_checked() and not boxes(page).nth(1).is_checked()

    # Leave, and come back by Material's instant navigation: the page is fetched and swapped into
    # the same document, and only document$ tells the script. Its link handler only intercepts
    # links listed in sitemap.xml, whose URLs must match the serving host and port (site_url),
    # which a loopback server on a random port cannot; so the test does what that handler does.
    page.goto(site_url + "reference/")
    page.wait_for_load_state("networkidle")
    page.evaluate("window.sameDocument = true")  # gone if a new document were loaded
    page.evaluate("""() => {
        const url = new URL("study-plan/", location.href);
        history.pushState(null, "", url);
        location$.next(url);
    }""")
    page.wait_for_function("document.querySelector('article [data-checklist]') !== null")
    assert page.evaluate("window.sameDocument === true"), "the page was reloaded, not swapped in"
    assert boxes(page).nth(0).is_enabled() and boxes(page).nth(0).is_checked()

    page.locator("article [data-checklist-reset]").first.click()
    assert not boxes(page).nth(0).is_checked()
    page.reload()
    assert not boxes(page).nth(0).is_checked()
    assert not errors, f"JavaScript errors: {errors}"
