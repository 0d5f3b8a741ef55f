"""The web demo's APE switch (Chromium, headless)."""

from __future__ import annotations

import pytest

from tests.app.test_browser import CHROMIUM, page, wait_until  # noqa: F401 (`page`: the fixture)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed"),
]


def test_the_ape_switch_asks_for_apes_reading_at_fidelity_fast(page):  # noqa: F811
    assert page.is_visible("#ape-option")
    assert "divided by 0.9" in page.get_attribute("#ape-option", "title")
    page.select_option("#mode", "naive")
    page.fill("#max-tokens", "4")
    page.check("#ape")
    page.fill("#question", "When was the lighthouse first lit?")
    page.click("#ask-button")
    page.wait_for_selector("#chunks li", timeout=30_000)
    wait_until(page, "!document.querySelector('#ask-button').disabled", timeout=30_000)
    assert page.is_hidden("#ask-error")
    assert "read the chunks by APE's knobs" in page.inner_text("#timings")
    page.select_option("#mode", "cachecraft")  # not a mode that reads base variants only
    page.click("#ask-button")
    page.wait_for_selector("#ask-error:not([hidden])", timeout=20_000)
    assert "base variants only" in page.inner_text("#ask-error")
