"""What the chat UI draws besides plain text (issue 15, acceptance 2, 3 and 4): highlighted
code blocks with a copy button, the folded Thinking block of a streamed reasoning answer,
tool-call cards, and answers in a JSON Schema (a bad schema is refused before sending).

The tiny random model writes what the regex or the schema makes it write, so these answers
come from the live server. Screenshots: tests/artifacts/render-*.png. Fixtures: conftest.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from playwright.sync_api import expect

SIZES = [(390, 844), (1280, 800)]

PYTHON = (
    'def greet(name):\n    """Say hello."""\n    return f"hello {name}"  # a comment\n\nprint(greet("x"))'
)
HTML = '<img src=x onerror="window.__pwned = 1">\n<script>window.__pwned = 2</script>'
CODE_ANSWER = f"Here it is:\n\n```python\n{PYTHON}\n```\n\nAnd markup:\n\n```html\n{HTML}\n```\n\nDone."

# The server splits a leading <think> block into `reasoning` messages. Words of lower-case
# letters, so that neither part can be blank (the split drops the whitespace around it).
THINK_REGEX = r"<think>[a-z]{2,8}( [a-z]{2,8}){3,6}</think>[a-z]{2,8}( [a-z]{2,8}){1,3}"
# A live answer with a code block in it (the regex box is one line: `\n` is the regex escape).
CODE_REGEX = r"```python\ndef [a-z]{1,8}\(\):\n    return [0-9]{1,3}\n```"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

# Every element under the message list: nothing active may come out of highlighting.
ACTIVE = """() => [...document.querySelectorAll('#messages *')]
  .filter((el) => /^(img|script|iframe|object|embed|style|link)$/i.test(el.tagName) ||
    [...el.attributes].some((a) => a.name.startsWith('on')))
  .map((el) => el.outerHTML.slice(0, 80))"""


def shoot(ui: Any, page: Any, name: str) -> None:
    ui.ARTIFACTS.mkdir(parents=True, exist_ok=True)
    size = page.viewport_size
    page.screenshot(path=str(ui.ARTIFACTS / f"render-{name}-{size['width']}x{size['height']}.png"))


def sent_frames(page: Any) -> list[dict[str, Any]]:
    """Reload `page` with its socket's outgoing frames recorded (JSON) into the list returned."""
    frames: list[dict[str, Any]] = []
    received: list[dict[str, Any]] = []

    def on_ws(ws: Any) -> None:
        ws.on("framesent", lambda payload: frames.append(json.loads(payload)))
        ws.on("framereceived", lambda payload: received.append(json.loads(payload)))

    page.on("websocket", on_ws)
    page.reload()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
    page.received = received
    return frames


def set_format(page: Any, mode: str, text: str = "") -> None:
    """Pick the answer format in its dialog (and type the schema or the regex)."""
    page.click("#format-button")
    dialog = page.locator("#format-dialog")
    expect(dialog).to_be_visible()
    dialog.locator(f"input[name=format-mode][value={mode}]").check()
    if mode == "schema":
        page.fill("#format-schema", text)
    elif mode == "regex":
        page.fill("#format-regex", text)


def close_format(page: Any) -> None:
    page.click("#format-dialog button.primary")
    expect(page.locator("#format-dialog")).to_be_hidden()


def stored_messages(page: Any) -> list[dict[str, Any]]:
    return page.evaluate(
        "() => JSON.parse(localStorage.getItem('wsllm.v1.conv.' + JSON.parse(localStorage.getItem('wsllm.v1.active')))).messages"
    )


def test_code_blocks_are_highlighted_and_copy_only_the_code(ui) -> None:
    conv = ui.conversation("ccode", "Code", [("user", "Show me code."), ("assistant", CODE_ANSWER)])
    keyword_colours = {}
    for size, scheme in [(SIZES[0], "light"), (SIZES[1], "dark"), (SIZES[1], "light")]:
        page = ui.page(size, scheme, convs=[conv], settings={**ui.FAST, "max_tokens": 60})
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=ui.server.url)
        answer = ui.last_answer(page)
        py, html = answer.locator(".codeblock").nth(0), answer.locator(".codeblock").nth(1)
        expect(py.locator(".codelang")).to_have_text("python")
        expect(py.locator("code.hljs .hljs-keyword").first).to_have_text("def")
        assert py.locator(".hljs-string").count() >= 2 and py.locator(".hljs-comment").count() == 1
        # Highlighting adds spans around the tokens and changes no character of the code.
        assert py.locator("code").text_content() == PYTHON
        # Markup in a code block is highlighted as text: nothing in it became an element.
        expect(html.locator(".hljs-tag").first).to_be_visible()
        assert html.locator("code").text_content() == HTML
        assert page.evaluate(ACTIVE) == []
        assert page.evaluate("window.__pwned") is None

        py.locator("button.copy-code").click()
        expect(py.locator("button.copy-code")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == PYTHON
        expect(py.locator("button.copy-code")).to_have_text("Copy")
        # The highlight theme follows the page's: a11y-light's keyword colour, or a11y-dark's.
        keyword_colours[scheme] = py.locator(".hljs-keyword").first.evaluate(
            "(el) => getComputedStyle(el).color"
        )
        shoot(ui, page, f"code-{scheme}")
    assert keyword_colours == {"light": "rgb(121, 40, 161)", "dark": "rgb(220, 198, 224)"}

    # A live answer: the server's regex makes the model write a fenced block, highlighted once
    # it is complete.
    set_format(page, "regex", CODE_REGEX)
    close_format(page)
    ui.send(page, "Write a function.")
    ui.wait_finished(page)
    live = ui.last_answer(page).locator(".codeblock")
    expect(live.locator(".codelang")).to_have_text("python")
    expect(live.locator(".hljs-keyword").first).to_have_text("def")
    code = live.locator("code").text_content()
    assert re.fullmatch(r"def [a-z]{1,8}\(\):\n    return [0-9]{1,3}", code), code
    live.locator("button.copy-code").click()
    expect(live.locator("button.copy-code")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == code
    ui.assert_no_errors(page)


def test_slow_blocks_are_highlighted_over_several_repaints(ui) -> None:
    # 20,000 `"` take highlight.js's C# grammar about 0.4 s: one repaint highlights blocks for
    # 25 ms at most and leaves the rest to the next ones. All of them get there; a block over
    # the 10,000-character cap stays plain.
    quotes = '"' * 6000
    slow = "".join(f"```csharp\n// block {k}\n{quotes}\n```\n\n" for k in range(4))
    huge = "```python\n" + "x = 1\n" * 2000 + "```"
    conv = ui.conversation("cslow", "Slow", [("user", "Many blocks."), ("assistant", slow + huge)])
    page = ui.page(convs=[conv])
    blocks = ui.last_answer(page).locator(".codeblock code")
    expect(blocks).to_have_count(5)
    expect(ui.last_answer(page).locator(".codeblock code.hljs")).to_have_count(4, timeout=30_000)
    assert "hljs" not in (blocks.nth(4).get_attribute("class") or "")
    assert blocks.nth(4).text_content() == "x = 1\n" * 1999 + "x = 1"
    ui.assert_no_errors(page)


def hold_after_reasoning(page: Any) -> dict[str, Any]:
    """Reload `page` with its socket routed through Playwright: the server's messages pass
    until the first answer text (`delta` or `done`); that one and all after it are held until
    `release`. So the page shows a streaming answer that has only thought so far."""
    state: dict[str, Any] = {"held": [], "seen": [], "hold": True}

    def route(ws: Any) -> None:
        state["route"] = ws
        server = ws.connect_to_server()

        def from_server(message: str | bytes) -> None:
            msg = json.loads(message)
            state["seen"].append(msg)
            if state["hold"] and (state["held"] or msg.get("type") in ("delta", "done")):
                state["held"].append(message)
            else:
                ws.send(message)

        server.on_message(from_server)

    page.route_web_socket(re.compile(r"/v1/ws"), route)
    page.reload()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
    return state


def release(state: dict[str, Any]) -> None:
    state["hold"] = False
    for message in state["held"]:
        state["route"].send(message)


def test_a_streamed_reasoning_answer_shows_a_folded_thinking_block(ui) -> None:
    for size in SIZES:
        page = ui.page(size, settings={**ui.FAST, "max_tokens": 160})
        socket = hold_after_reasoning(page)
        set_format(page, "regex", THINK_REGEX)
        close_format(page)
        expect(page.locator("#format-button")).to_have_text("Regex")
        ui.send(page, "Think before you answer.")
        for _ in range(300):  # the Playwright calls here let the routed messages through
            if socket["held"]:
                break
            page.wait_for_timeout(50)
        assert socket["held"], "the answer never started"

        # While it streams: the answer has only thought. The block is folded, says so, and
        # already holds the text so far.
        answer = ui.last_answer(page)
        thinking = answer.locator("details.thinking")
        streamed = "".join(m["text"] for m in socket["seen"] if m.get("type") == "reasoning")
        assert streamed.strip(), "the server sent no reasoning"
        expect(answer).to_have_attribute("data-status", "streaming")
        expect(thinking.locator(".thinking-title")).to_have_text("Thinking…")
        assert thinking.evaluate("(d) => d.open") is False
        expect(thinking.locator(".thinking-text")).to_have_text(streamed.strip(), use_inner_text=False)
        expect(answer.locator(".answer")).to_be_empty()
        shoot(ui, page, "thinking-live")
        release(socket)
        ui.wait_finished(page)

        answer = ui.last_answer(page)
        thinking = answer.locator("details.thinking")
        expect(thinking).to_have_count(1)
        assert thinking.evaluate("(d) => d.open") is False  # folded
        expect(thinking.locator("summary")).to_have_text(re.compile(r"^Thought for \d+(\.\d)? s$"))
        reasoning = thinking.locator(".thinking-text").text_content()
        assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){3,6}", reasoning), reasoning
        text = answer.locator(".answer").inner_text()
        assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}", text), text
        assert "<think>" not in answer.locator(".msg-body").inner_text()
        # The answer is below the block.
        assert answer.locator(".answer").bounding_box()["y"] > thinking.bounding_box()["y"]
        shoot(ui, page, "thinking")
        thinking.locator("summary").click()
        expect(thinking.locator(".thinking-text")).to_be_visible()
        shoot(ui, page, "thinking-open")

        # Stored in the message's `reasoning`, and drawn again after a reload.
        last = stored_messages(page)[-1]
        assert last["reasoning"].strip() == reasoning and last["content"] == text
        assert last["thinkingMs"] >= 0
        page.reload()
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
        again = ui.last_answer(page).locator("details.thinking")
        expect(again).not_to_have_attribute("open", "")
        assert again.locator(".thinking-text").text_content() == reasoning
        expect(ui.last_answer(page).locator(".answer")).to_have_text(text)
        ui.assert_no_errors(page)


def test_tool_calls_are_assembled_into_cards(ui) -> None:
    page = ui.page(settings={**ui.FAST, "max_tokens": 120})
    # The deltas of docs/protocol.md's example, in pieces: merged per index as OpenAI's are.
    merged = page.evaluate("""async () => {
      const { mergeToolCalls } = await import('/answer-data.js');
      const msg = {};
      mergeToolCalls(msg, [{index: 0, id: 'call_a', type: 'function', function: {name: 'get_weather', arguments: ''}}]);
      mergeToolCalls(msg, [{index: 0, function: {arguments: '{"city": '}}, {index: 1, id: 'call_b',
                           function: {name: 'get_time', arguments: '{}'}}]);
      mergeToolCalls(msg, [{index: 0, function: {arguments: '"Oslo"}'}}]);
      return msg.toolCalls;
    }""")
    assert merged == [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"id": "call_b", "name": "get_time", "arguments": "{}"},
    ]
    # From the live server: this starts a request with `tools` on the page's own socket,
    # through the same handlers a chat answer uses (test_ui_tools.py drives the editor).
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    page.evaluate(
        """(tools) => {
      const { chat, ws, view, store } = window.wsllm;
      const conv = chat.get(store.activeId);
      conv.messages.push({id: 'u1', role: 'user', content: 'Weather in Oslo?', createdAt: Date.now()});
      const msg = {id: 'a1', role: 'assistant', content: '', status: 'waiting', stats: {}, createdAt: Date.now()};
      conv.messages.push(msg);
      view.sync();
      const rt = {sentAt: performance.now(), firstAt: null, deltas: 0};
      ws.request({type: 'chat', messages: [{role: 'user', content: 'Weather in Oslo?'}], tools,
                  tool_choice: 'required', parallel_tool_calls: false, max_tokens: 120, temperature: 0},
                 chat._handlers(conv, msg, rt));
    }""",
        tools,
    )
    ui.wait_finished(page)
    card = ui.last_answer(page).locator(".tool-call")
    expect(card).to_have_count(1)
    expect(card.locator(".tool-call-name")).to_have_text("get_weather")
    expect(card.locator(".tool-call-id")).to_have_text(re.compile(r"^call_[0-9a-f]{24}$"))
    args_text = card.locator("code.hljs").text_content()
    args = json.loads(args_text)
    jsonschema.validate(args, tools[0]["function"]["parameters"])
    assert args_text == json.dumps(args, indent=2, ensure_ascii=False)  # pretty-printed
    stored = stored_messages(page)[-1]
    assert (
        stored["toolCalls"][0]["name"] == "get_weather"
        and json.loads(stored["toolCalls"][0]["arguments"]) == args
    )
    shoot(ui, page, "tool-call")
    ui.assert_no_errors(page)


def test_json_schema_answers_are_formatted_and_valid(ui) -> None:
    for size in SIZES:
        page = ui.page(size, settings={**ui.FAST, "max_tokens": 80})
        frames = sent_frames(page)
        set_format(page, "schema", json.dumps(SCHEMA, indent=1))
        expect(page.locator("#format-check")).to_be_hidden()
        shoot(ui, page, "format-dialog")
        close_format(page)
        expect(page.locator("#format-button")).to_have_text("Schema")
        ui.send(page, "A person, please.")
        ui.wait_finished(page)

        chat = [f for f in frames if f.get("type") == "chat"][-1]
        assert chat["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "ui", "schema": SCHEMA, "strict": True},
        }
        answer = ui.last_answer(page)
        expect(answer.locator(".codelang")).to_have_text("json")
        shown = answer.locator("code.hljs").text_content()
        value = json.loads(shown)
        jsonschema.validate(value, SCHEMA)
        assert shown == json.dumps(value, indent=2, ensure_ascii=False)  # formatted, not compact
        assert answer.locator(".hljs-attr").count() == 3  # the three keys, highlighted
        assert stored_messages(page)[-1]["json"] is True
        shoot(ui, page, "json")
        # The format stays with the conversation, and the answer is drawn the same after a reload.
        page.reload()
        expect(page.locator("#format-button")).to_have_text("Schema")
        expect(ui.last_answer(page).locator("code.hljs")).to_have_text(shown)
    ui.assert_no_errors(page)


def test_a_bad_schema_is_refused_before_sending(ui) -> None:
    page = ui.page(settings={**ui.FAST, "max_tokens": 16})
    frames = sent_frames(page)
    server = ui.server
    counted = ("wsllm_requests_total", "wsllm_request_errors_total")
    before = [server.metric(m) for m in counted]
    cases = [
        ('{"type": "object", "properties": ', "not valid JSON"),
        ('["type", "object"]', "must be a JSON object ({ … }), not an array"),
        ('{"type": "string"}', 'needs "type": "object"'),
    ]
    for k, (schema, reason) in enumerate(cases):
        set_format(page, "schema", schema)
        expect(page.locator("#format-check")).to_contain_text(reason)  # said while typing
        close_format(page)
        expect(page.locator("#format-button")).to_have_attribute("aria-label", re.compile("needs fixing"))
        ui.send(page, f"Question {k}")
        refusal = page.locator("#format-error")
        expect(refusal).to_be_visible()
        expect(refusal).to_contain_text(f"Not sent: The JSON Schema {'is' if k == 0 else 'must'}")
        expect(refusal).to_contain_text(reason)
        expect(page.locator("#prompt")).to_have_value(f"Question {k}")  # kept, to send once fixed
        if k == 0:
            shoot(ui, page, "bad-schema")
    page.wait_for_timeout(300)
    expect(page.locator(".msg")).to_have_count(0)
    assert not [f for f in frames if f.get("type") == "chat"], frames
    assert [server.metric(m) for m in counted] == before

    # "Edit format" reopens the dialog; a fixed schema clears the refusal, and JSON object mode
    # asks for any object.
    page.click("#format-error button")
    expect(page.locator("#format-dialog")).to_be_visible()
    page.locator("input[name=format-mode][value=json]").check()
    close_format(page)
    expect(page.locator("#format-error")).to_be_hidden()
    page.press("#prompt", "Enter")
    ui.wait_finished(page)
    chat = [f for f in frames if f.get("type") == "chat"]
    assert len(chat) == 1 and chat[0]["response_format"] == {"type": "json_object"}
    assert "structured_outputs" not in chat[0]
    ui.assert_no_errors(page)
