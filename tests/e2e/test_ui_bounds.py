"""The settings dialog's ranges are the server's: a sampling bound changed in its one
declaration (wsllm.bounds.SAMPLING_BOUNDS) changes what the UI accepts, through the
hello's `bounds` (tests/integration/test_bounds.py follows the same change into the
400 and the wire). Fixture: `ui_narrow` (tests/e2e/conftest.py)."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import expect


def test_the_settings_take_a_changed_bound_from_the_hello(ui_narrow: Any) -> None:
    page = ui_narrow.page()
    page.click("#open-settings")
    page.fill("#set-presence-penalty", "0.75")  # inside the usual [-2, 2]
    expect(page.locator("#err-presence-penalty")).to_have_text(
        "Presence penalty must be a number from -0.5 to 0.5. Not saved."
    )
    page.fill("#set-frequency-penalty", "0.75")  # its neighbour keeps its own range
    expect(page.locator("#err-frequency-penalty")).to_be_hidden()
    page.fill("#set-presence-penalty", "0.5")
    expect(page.locator("#err-presence-penalty")).to_be_hidden()
    stored = page.evaluate("JSON.parse(localStorage.getItem('wsllm.v1.settings'))")
    assert (stored["presence_penalty"], stored["frequency_penalty"]) == (0.5, 0.75)
    ui_narrow.assert_no_errors(page)
