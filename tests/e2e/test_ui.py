"""Chatting in the browser: streaming, figures, stop, two conversations at once, and
server errors (issue 7, acceptance 1 and 2). Fixtures: tests/e2e/conftest.py."""

from __future__ import annotations

import re

from playwright.sync_api import expect


def test_answer_streams_in_several_updates_and_shows_figures(ui) -> None:
    # Long enough (about a second on a CPU) that a busy machine still paints it in steps.
    page = ui.page(settings={**ui.FAST, "max_tokens": 200})
    # Count the distinct lengths the answer's text has while it is still streaming.
    page.evaluate("""() => {
      window.__lengths = new Set();
      new MutationObserver(() => {
        const a = [...document.querySelectorAll('.msg.assistant')].pop();
        if (a && a.dataset.status === 'streaming') window.__lengths.add(a.querySelector('.msg-body').textContent.length);
      }).observe(document.getElementById('messages'),
                 {subtree: true, childList: true, characterData: true, attributes: true});
    }""")
    page.fill("#prompt", "Tell me a story.")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    page.type("#prompt", "With a dragon.")
    expect(page.locator(".msg")).to_have_count(0)
    page.press("#prompt", "Enter")
    expect(page.locator(".msg.user .msg-body")).to_have_text("Tell me a story.\nWith a dragon.")
    expect(page.locator("#prompt")).to_have_value("")
    ui.wait_finished(page)
    assert page.evaluate("[...window.__lengths].filter((n) => n > 0).length") >= 3

    answer = ui.last_answer(page)
    expect(answer.locator(".msg-body")).not_to_be_empty()
    expect(answer.locator("[data-testid=ttft]")).to_have_text(re.compile(r"^TTFT \d+(\.\d+)? m?s$"))
    expect(answer.locator("[data-testid=tps]")).to_have_text(re.compile(r"^\d+\.\d tok/s$"))
    tokens = int(answer.locator("[data-testid=tokens]").inner_text().split()[0])
    assert 1 <= tokens <= 200
    if answer.locator("[data-testid=finish]").count():  # stopped at max_tokens
        assert tokens == 200
    expect(page.locator("#send")).to_be_visible()
    ui.assert_no_errors(page)


def test_stop_aborts_on_the_server_and_the_ui_sends_again(ui) -> None:
    server = ui.server
    page = ui.page(settings={**ui.FAST, "max_tokens": 1500})
    aborts = server.metric("wsllm_request_aborts_total")
    ui.send(page, "Count to a thousand.")
    answer = ui.last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming", timeout=15_000)
    # The engine reports what it runs in its heartbeats, which /metrics shows.
    running = "wsllm_num_requests_running"
    ui.wait_until(lambda: server.metric(running) >= 1, what="the engine to report the request running")
    page.click("#stop")
    expect(answer).to_have_attribute("data-status", "stopped")
    text = answer.locator(".msg-body").inner_text()
    expect(answer.locator("[data-testid=finish]")).to_have_text("stopped")
    ui.wait_until(
        lambda: server.metric("wsllm_request_aborts_total") > aborts, what="the gateway to count the abort"
    )
    ui.wait_until(lambda: server.metric(running) == 0, what="the engine to drop the aborted request")
    page.wait_for_timeout(300)
    assert answer.locator(".msg-body").inner_text() == text, "text kept coming after stop"

    # At once: no waiting for the server's answer to the cancel.
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    ui.set_settings(page, max_tokens="12")
    ui.send(page, "Now something short.")
    expect(page.locator(".msg.assistant")).to_have_count(2)
    ui.wait_finished(page)
    expect(ui.last_answer(page)).to_have_attribute("data-status", "done")
    ui.assert_no_errors(page)


def test_two_conversations_stream_at_once_and_esc_stops(ui) -> None:
    page = ui.page(settings={**ui.FAST, "max_tokens": 1500})
    ui.send(page, "A long answer, please.")
    expect(ui.last_answer(page)).to_have_attribute("data-status", "streaming", timeout=15_000)
    first = page.locator(".conv-item.active").get_attribute("data-id")

    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    ui.set_settings(page, max_tokens="12")
    ui.send(page, "And a short one here.")
    ui.wait_finished(page)
    # The first conversation is still answering meanwhile.
    expect(page.locator(f'.conv-item[data-id="{first}"] .live-dot')).to_be_visible()

    page.click(f'.conv-item[data-id="{first}"] .conv-select')
    answer = ui.last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming")
    page.keyboard.press("Escape")
    expect(answer).to_have_attribute("data-status", "stopped")
    expect(page.locator(".live-dot")).to_have_count(0)
    ui.assert_no_errors(page)


def test_server_errors_show_as_readable_messages(ui) -> None:
    page = ui.page(settings={**ui.FAST, "max_tokens": 1_000_000})
    ui.send(page, "Hello?")
    answer = ui.last_answer(page)
    expect(answer.locator(".msg-error")).to_be_visible()
    expect(answer.locator(".msg-error")).to_contain_text("max_tokens")
    expect(answer).to_have_attribute("data-status", "error")
    expect(page.locator("#send")).to_be_visible()  # not stuck

    # Fixing the setting and retrying from the failed answer works.
    ui.set_settings(page, max_tokens="8")
    answer.get_by_role("button", name="Try again").click()
    ui.wait_finished(page)
    expect(page.locator(".msg.assistant")).to_have_count(1)
    expect(page.locator(".msg-error:visible")).to_have_count(0)


def test_edit_and_resend_regenerate_and_copy(ui) -> None:
    page = ui.page(settings={**ui.FAST, "max_tokens": 8})
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    ui.send(page, "First question.")
    ui.wait_finished(page)
    ui.send(page, "Second question.")
    ui.wait_finished(page)
    expect(page.locator(".msg")).to_have_count(4)

    # Regenerate replaces the last answer only.
    first_answer = page.locator(".msg.assistant").first.get_attribute("data-id")
    last_id = ui.last_answer(page).get_attribute("data-id")
    ui.last_answer(page).get_by_role("button", name="Regenerate answer").click()
    ui.wait_finished(page)
    expect(page.locator(".msg")).to_have_count(4)
    assert ui.last_answer(page).get_attribute("data-id") != last_id
    assert page.locator(".msg.assistant").first.get_attribute("data-id") == first_answer

    # Editing the first message cuts the conversation there and asks again.
    page.locator(".msg.user").first.get_by_role("button", name="Edit and resend").click()
    box = page.locator("textarea.edit-box")
    expect(box).to_be_focused()
    box.fill("The first question, edited.")
    box.press("Enter")
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator(".msg.user .msg-body")).to_have_text("The first question, edited.")
    ui.wait_finished(page)

    # Copy puts the message's text on the clipboard.
    page.locator(".msg.user").first.get_by_role("button", name="Copy your message").click()
    assert page.evaluate("navigator.clipboard.readText()") == "The first question, edited."
    ui.last_answer(page).get_by_role("button", name="Copy answer").click()
    stored = page.evaluate("wsllm.chat.get(wsllm.store.activeId).messages[1].content")
    assert page.evaluate("navigator.clipboard.readText()") == stored
    ui.assert_no_errors(page)
