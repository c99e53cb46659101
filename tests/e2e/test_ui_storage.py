"""What the UI keeps in localStorage: stored model text renders inert, and
conversations and settings survive a reload (issue 7, acceptance 3 and 4)."""

from __future__ import annotations

import json

from playwright.sync_api import expect

HOSTILE = "\n\n".join(
    [
        'Look: <img src=x onerror="window.__pwned = 1">',
        "<script>window.__pwned = 2</script>",
        '<svg onload="window.__pwned = 3"><circle r="9"/></svg>',
        '<iframe src="javascript:window.__pwned = 4"></iframe>',
        '<a href="javascript:window.__pwned = 5">raw link</a>',
        "[md link](javascript:window.__pwned=6) and [data](data:text/html,<script>window.__pwned=7</script>)",
        "![remote image](http://127.0.0.1:9/pixel.png)",
        '```html\n<img src=x onerror="window.__pwned = 8">\n```',
        "`<script>window.__pwned = 9</script>` and a [fine link](https://example.com/docs)",
    ]
)

# Every element inside the message list, sidebar and title: none may be active.
FIND_ACTIVE = """() => {
  const all = [...document.querySelectorAll('#messages *, #conv-list *, #conv-title *')];
  const bad = all.filter((el) => /^(img|script|iframe|object|embed|video|audio|form|style|link|details)$/i
    .test(el.tagName));
  const handlers = all.filter((el) =>
    [...el.attributes].some((a) => a.name.startsWith('on') || /^\\s*(javascript|data):/i.test(a.value)));
  const links = [...document.querySelectorAll('.msg.assistant a')].map((a) => [a.href, a.rel, a.target]);
  return {bad: bad.map((el) => el.tagName), handlers: handlers.map((el) => el.outerHTML.slice(0, 80)), links};
}"""

# The renderer itself, fed more vectors, makes only plain elements with at most a class.
RENDER_MORE = """async () => {
  const { renderMarkdown } = await import('/markdown.js');
  const box = document.createElement('div');
  box.append(renderMarkdown(
    '<details open ontoggle=window.__pwned=11>x</details> <body onload=window.__pwned=12>' +
    '\\n\\n[x](  JaVaScRiPt:window.__pwned=13) <javascript:window.__pwned=14> **<b onclick=1>**' +
    '\\n\\n| a | <img src=x onerror=window.__pwned=15> |\\n|---|---|\\n| [y](vbscript:x) | z |'));
  document.body.append(box);
  await new Promise((r) => setTimeout(r, 200));
  const els = [...box.querySelectorAll('*')];
  box.remove();
  const plain = ['P', 'STRONG', 'TABLE', 'THEAD', 'TBODY', 'TR', 'TH', 'TD', 'DIV', 'BR'];
  return window.__pwned === undefined && els.every((el) => plain.includes(el.tagName) &&
    el.attributes.length <= 1 && (!el.attributes.length || el.hasAttribute('class')));
}"""


def test_stored_hostile_markup_renders_inert(ui) -> None:
    conv = ui.conversation(
        "cxss", "<img src=x onerror=window.__pwned=10>", [("user", HOSTILE), ("assistant", HOSTILE)]
    )
    requests: list[str] = []
    page = ui.page(convs=[conv], requests=requests)
    body = ui.last_answer(page).locator(".msg-body")
    expect(body).to_contain_text('<img src=x onerror="window.__pwned = 1">')
    expect(body).to_contain_text("<script>window.__pwned = 2</script>")
    page.wait_for_timeout(300)  # time for any error/load handler to have fired

    assert page.evaluate("window.__pwned") is None
    found = page.evaluate(FIND_ACTIVE)
    assert found["bad"] == [] and found["handlers"] == [], found
    # Only http(s) links survive, and they open in a new tab with no opener.
    assert ["https://example.com/docs", "noopener noreferrer nofollow", "_blank"] in found["links"]
    assert all(href.startswith(("http://", "https://")) for href, _, _ in found["links"])
    # The image became a link and was never fetched; nothing left the page's origin.
    origin = ui.server.url
    assert all(u.startswith((origin, origin.replace("http", "ws"), "data:")) for u in requests), requests
    assert page.evaluate(RENDER_MORE)
    assert page.title().startswith("<img src=x")  # the title is text too


def test_conversations_and_settings_survive_reload(ui) -> None:
    page = ui.page()
    ui.send(page, "Remember this chat.")
    ui.wait_finished(page)
    page.click(".conv-item.active [data-action=rename]")
    page.fill(".conv-rename-input", "Kept chat")
    page.press(".conv-rename-input", "Enter")
    page.click("#system-box summary")
    page.fill("#system-prompt", "Answer briefly.")

    page.click("#new-chat")
    ui.send(page, "A second chat.")
    ui.wait_finished(page)
    model = json.loads(ui.http_get(ui.server.url + "/v1/models")[1])["data"][0]["id"]
    page.click("#open-settings")
    page.select_option("#set-model", model)
    page.fill("#set-temperature", "1.3")
    page.fill("#set-top-p", "0.9")
    page.fill("#set-max-tokens", "33")
    page.fill("#set-seed", "7")
    page.click("#settings-dialog button.primary")
    page.click("#theme-toggle")  # auto -> light
    page.click("#theme-toggle")  # light -> dark

    page.reload()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
    expect(page.locator(".conv-item .conv-title-text")).to_have_text(["A second chat.", "Kept chat"])
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    page.click(".conv-item:has-text('Kept chat') .conv-select")
    expect(page.locator("#conv-title")).to_have_text("Kept chat")
    expect(page.locator(".msg.user .msg-body")).to_have_text("Remember this chat.")
    expect(page.locator(".msg.assistant")).to_have_count(1)
    expect(page.locator("#system-prompt")).to_have_value("Answer briefly.")
    page.click("#open-settings")
    expect(page.locator("#set-model")).to_have_value(model)
    expect(page.locator("#set-temperature")).to_have_value("1.3")
    expect(page.locator("#set-top-p")).to_have_value("0.9")
    expect(page.locator("#set-max-tokens")).to_have_value("33")
    expect(page.locator("#set-seed")).to_have_value("7")

    # Delete asks twice; the kept chat goes, the other stays after another reload.
    page.click("#settings-dialog button.primary")
    page.click(".conv-item.active [data-action=delete]")
    page.click(".conv-item.active [data-action=delete]")
    expect(page.locator(".conv-item")).to_have_count(1)
    page.reload()
    expect(page.locator(".conv-item .conv-title-text")).to_have_text(["A second chat."])
    ui.assert_no_errors(page)


def test_a_system_prompt_typed_just_before_a_reload_is_kept(ui) -> None:
    # Typing is saved on a 300 ms throttle; leaving the page must write it at once.
    page = ui.page()
    ui.send(page, "A chat to annotate.")
    ui.wait_finished(page)
    page.click("#system-box summary")
    page.fill("#system-prompt", "Typed a moment before leaving.")
    page.reload()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
    page.click(".conv-item:has-text('A chat to annotate') .conv-select")
    expect(page.locator("#system-prompt")).to_have_value("Typed a moment before leaving.")
