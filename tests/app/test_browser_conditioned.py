"""The web demo's conditioned-bases switch, on a server that conditions bases (Chromium,
headless)."""

from __future__ import annotations

import pytest

from tests.app.test_browser import CHROMIUM, page, wait_until  # noqa: F401 (`page`: the fixture)
from tests.app.test_conditioned import services  # noqa: F401 (the fixture)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed"),
]


def test_the_conditioned_switch_asks_for_conditioned_bases_at_fidelity_fast(page):  # noqa: F811
    assert page.is_visible("#conditioned-option") and page.is_hidden("#packets-option")
    assert "2 nearest chunks" in page.get_attribute("#conditioned-option", "title")
    page.select_option("#mode", "naive")
    page.fill("#max-tokens", "4")
    page.check("#conditioned")
    page.fill("#question", "When was the lighthouse first lit?")
    page.click("#ask-button")
    page.wait_for_selector("#chunks li", timeout=30_000)
    wait_until(page, "!document.querySelector('#ask-button').disabled", timeout=30_000)
    assert page.is_hidden("#ask-error")
    assert "read from their conditioned bases" in page.inner_text("#timings")
    page.select_option("#mode", "prefix")  # not a mode that reads them: the server says
    page.click("#ask-button")
    page.wait_for_selector("#ask-error:not([hidden])", timeout=20_000)
    assert "base variants only" in page.inner_text("#ask-error")
