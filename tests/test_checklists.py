"""The study plan's checklists in headless Chromium: a tick survives a reload, an instant-
navigation page change and a rewording of its item, whose id keys it (docs/assets/js/checklists.js,
state in localStorage).

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


def test_a_tick_follows_the_item_id_when_the_item_is_reworded(page, site_url):  # noqa: F811
    """Ticks are keyed by each item's `data-checklist-id`: an item reworded in a later version
    of the page keeps its tick, and a tick stored under an item's text (before ids) moves to
    its id once."""
    page, errors = page
    url = site_url + PAGE
    page.goto(url)
    item = page.locator("article .task-list-item:has([data-checklist-id='ex-16'])")
    assert item.count() == 1, "the study plan has no item with data-checklist-id='ex-16'"
    item.locator("label").first.dispatch_event("click")
    assert item.locator("input[type=checkbox]").is_checked()
    stored = page.evaluate("Object.keys(localStorage).filter(k => k.startsWith('checklist:'))")
    assert [k.rsplit("::", 1)[1] for k in stored] == ["#ex-16"], stored

    # The same page, its item reworded, as a later version of the site would serve it.
    def reworded(route):
        html = route.fetch().text()
        assert "Exercise 16: your own ring all-reduce" in html
        route.fulfill(body=html.replace("Exercise 16: your own ring all-reduce",
                                        "Exercise 16, reworded: a ring all-reduce of your own"),
                      content_type="text/html")

    page.route(url, reworded)
    try:
        page.goto(url)
        assert "reworded" in item.inner_text()
        assert item.locator("input[type=checkbox]").is_checked(), "the reworded item lost its tick"
    finally:
        page.unroute(url)

    # A tick from before ids, stored under the item's text, is moved to the id once.
    page.evaluate("localStorage.clear()")
    page.goto(url)
    old_key = page.evaluate("""() => {
        const li = document.querySelector("article .task-list-item:has([data-checklist-id='ex-17'])");
        const copy = li.cloneNode(true);
        copy.querySelectorAll("ul, ol, label").forEach((n) => n.remove());
        const key = "checklist:" + location.pathname.replace(/index\\.html$/, "") + "::"
            + copy.textContent.replace(/\\s+/g, " ").trim();
        localStorage.setItem(key, "1");
        return key;
    }""")
    page.reload()
    ex17 = page.locator("article .task-list-item:has([data-checklist-id='ex-17'])")
    assert ex17.locator("input[type=checkbox]").is_checked(), "the text-keyed tick was not migrated"
    keys = page.evaluate("Object.keys(localStorage)")
    assert old_key not in keys and any(k.endswith("::#ex-17") for k in keys), keys
    page.locator("article [data-checklist-reset]").first.click()
    assert not ex17.locator("input[type=checkbox]").is_checked()
    assert not errors, f"JavaScript errors: {errors}"
