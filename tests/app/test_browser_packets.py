"""The web demo's packets switch, on a server with learned packets (Chromium, headless)."""

from __future__ import annotations

import pytest

from tests.app.test_browser import CHROMIUM, page, wait_until  # noqa: F401 (`page`: the fixture)
from tests.app.test_packets import packets_file, services  # noqa: F401 (the fixtures)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed"),
]


def test_the_packets_switch_asks_with_packets_at_fidelity_fast(page):  # noqa: F811
    assert page.is_visible("#packets-option")
    assert "naive" in page.get_attribute("#packets-option", "title")
    page.select_option("#mode", "naive")
    page.fill("#max-tokens", "4")
    page.check("#packets")
    page.fill("#question", "When was the lighthouse first lit?")
    page.click("#ask-button")
    page.wait_for_selector("#chunks li", timeout=30_000)
    wait_until(page, "!document.querySelector('#ask-button').disabled", timeout=30_000)
    assert page.is_hidden("#ask-error")
    assert "between the learned packets" in page.inner_text("#timings")
    page.select_option("#mode", "cachecraft")  # not a mode that reads packets: the server says
    page.click("#ask-button")
    page.wait_for_selector("#ask-error:not([hidden])", timeout=20_000)
    assert "base variants only" in page.inner_text("#ask-error")
