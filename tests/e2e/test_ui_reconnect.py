"""The server goes away and comes back: the page shows it and reconnects by itself,
without a reload (issue 7, acceptance 6). Restarts the session's server on its port."""

from __future__ import annotations

import re

from playwright.sync_api import expect


def test_reconnects_without_reload_when_the_server_returns(ui) -> None:
    page = ui.page(settings={**ui.FAST, "max_tokens": 1500})
    page.evaluate("window.__sameDocument = true")
    ui.send(page, "Keep talking.")
    answer = ui.last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming", timeout=15_000)

    ui.server.stop()
    status = page.locator("#conn-status")
    expect(status).to_have_attribute("data-state", "disconnected", timeout=10_000)
    expect(status).to_contain_text("Disconnected")
    expect(answer.locator(".msg-status")).to_contain_text("reconnecting")

    ui.server.start()
    expect(status).to_have_attribute("data-state", "connected", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    # The cut answer resumes (a broker that can) or is marked interrupted (memory broker).
    expect(answer).to_have_attribute("data-status", re.compile("streaming|done|interrupted"), timeout=10_000)
    if answer.get_attribute("data-status") == "interrupted":
        expect(answer.locator(".msg-error")).to_contain_text("could not resume")
    else:
        page.keyboard.press("Escape")
    ui.set_settings(page, max_tokens="8")
    ui.send(page, "Are you back?")
    expect(page.locator(".msg.assistant")).to_have_count(2)
    ui.wait_finished(page)
    ui.assert_no_errors(page, allow="favicon|ERR_CONNECTION_REFUSED")  # the browser logs each refused try
