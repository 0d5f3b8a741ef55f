"""The web demo in Debian's Chromium (Playwright, headless): ask with streaming, compare modes,
admin; all of it under the page's Content-Security-Policy (the last test)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.app.conftest import ADMIN_TOKEN

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed"),
]
ARGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-gpu",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def wait_until(page, expression: str, timeout: float = 30_000) -> None:
    """Poll a JavaScript expression until it is truthy (`timeout` in ms). Playwright's own
    `wait_for_function` compiles the expression inside the page, which the page's CSP
    (no 'unsafe-eval') refuses; `evaluate` comes from outside the page and is not refused."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still false after {timeout / 1000:.0f} s: {expression}")
        page.wait_for_timeout(100)


# Every Content-Security-Policy violation of the page, recorded from its first script on.
CSP_RECORDER = (
    "window.cspViolations = []; document.addEventListener('securitypolicyviolation', "
    "e => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`));"
)


@pytest.fixture(scope="module")
def page(live_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.add_init_script(CSP_RECORDER)
        page.goto(live_url + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        yield page
        browser.close()
        assert errors == [], errors


def test_ask_streams_an_answer_and_shows_chunks(page):
    assert page.title() == "kvmosaic"
    page.select_option("#mode", "cacheblend")
    page.fill("#max-tokens", "8")
    page.fill("#question", "When was the lighthouse first lit?")
    page.click("#ask-button")
    page.wait_for_selector("#chunks li", timeout=30_000)
    wait_until(page, "!document.querySelector('#ask-button').disabled", timeout=30_000)
    assert page.is_hidden("#ask-error")
    chunks = page.locator("#chunks li.chunk")
    assert chunks.count() == 6  # the default top_k
    assert "Hollin Point Lighthouse" in chunks.first.inner_text()
    assert page.locator("#chunks mark.re").count() > 0  # recomputed tokens highlighted
    assert "TTFT" in page.inner_text("#timings")
    assert "fidelity" in page.inner_text(
        "#timings"
    )  # the guard's line (the test server runs `fast`)
    assert page.inner_text("#answer-mode").startswith("cacheblend")
    assert page.is_hidden("#packets-option")  # this server has no learned packets


def test_a_bad_question_shows_the_error(page):
    page.fill("#question", " ")
    page.click("#ask-button")
    page.wait_for_selector("#ask-error:not([hidden])", timeout=20_000)
    assert "question is empty" in page.inner_text("#ask-error")


def test_compare_modes_draws_ttft_bars(page):
    page.click("nav a[data-tab='compare']")
    checked = page.eval_on_selector_all(
        "#compare-modes input:checked", "boxes => boxes.map(b => b.value)"
    )
    assert checked == ["full", "cacheblend"] + (
        ["cachecraft"]
        if "cachecraft"
        in page.eval_on_selector_all("#compare-modes input", "b => b.map(x => x.value)")
        else []
    )
    page.fill("#compare-question", "How long is the ferry crossing?")
    page.click("#compare-button")
    wait_until(
        page,
        "document.querySelectorAll('.compare .ttft').length > 1 && "
        "[...document.querySelectorAll('.compare .ttft')].every(e => "
        "e.textContent.includes('TTFT'))",
        timeout=60_000,
    )
    widths = page.eval_on_selector_all(
        ".compare .bar", "bars => bars.map(b => parseFloat(b.style.width))"
    )
    assert len(widths) == len(checked) and max(widths) == pytest.approx(100.0)
    assert "faster than full" in page.inner_text(".compare [data-mode='cacheblend']")


def test_documents_and_admin_panels(page):
    page.click("nav a[data-tab='documents']")
    wait_until(page, "document.querySelectorAll('#doc-rows tr').length >= 4", timeout=20_000)
    page.fill("#doc-text", "The Oddie smokehouse smokes fish over oak chips.")
    page.fill("#doc-title", "Smokehouse")
    page.click("#doc-form button[type=submit]")
    wait_until(
        page,
        "document.querySelector('#doc-status').textContent.startsWith('Added')",
        timeout=30_000,
    )
    wait_until(
        page,
        "document.querySelector('#doc-rows').textContent.includes('Smokehouse')",
        timeout=20_000,
    )

    page.click("nav a[data-tab='admin']")
    page.fill("#admin-token", "wrong")
    page.click("#admin-form button[type=submit]")
    page.wait_for_selector("#admin-error:not([hidden])", timeout=20_000)
    assert "bearer token" in page.inner_text("#admin-error")
    page.fill("#admin-token", ADMIN_TOKEN)
    page.click("#admin-form button[type=submit]")
    page.wait_for_selector("#admin-stats:not([hidden])", timeout=20_000)
    assert page.locator("#tier-rows tr").count() == 2 and "cpu" in page.inner_text("#tier-rows")


def test_the_page_works_under_its_security_headers(page, live_url):
    """Runs last: every panel above was used under the CSP, and none of it broke a rule."""
    headers = page.request.get(live_url + "/").headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert page.evaluate("window.cspViolations") == []
    page.evaluate("document.body.setAttribute('style', 'color: red')")  # the recorder itself works
    wait_until(page, "window.cspViolations.length > 0", timeout=5_000)
    page.evaluate("window.cspViolations = []")
