"""Tools and text attachments in the chat UI (issue 25, acceptance 5), against the bundled
SmolLM2 served by a real `wsllm serve` (fixture `ui_smol`, conftest.py).

- A function defined in the tools editor, with `tool_choice` "required", is called by the model
  (the server's tool constraint forces the call; the schema's maxLength keeps it short) and shows
  as a card; a result typed under the card goes back as a `tool` message with the call's id. A bad
  parameters schema is refused before anything is sent.
- An attached .txt reaches the prompt: the server's `usage.prompt_tokens` grows by at least the
  file's length in tokens. Past the size cap a file is refused with a message; a chip can be
  removed before sending; the file stays with its message after a reload.
- Export and import keep the tools; the import refuses bad ones.
- No sideways overflow and no serious axe-core violation at 390x844 and 1280x800 with the
  editor open and chips shown. Screenshots: tests/artifacts/tools-*.png.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from playwright.sync_api import expect

SIZES = [(390, 844), (1280, 800)]
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "name": "get_weather",
    "description": "The weather now in a city",
    "parameters": json.dumps(PARAMS, indent=1),
}
# About 1.3 kB of plain text, well under the cap, well over the typed question.
NOTES = "".join(
    f"Line {k}: the lighthouse keeper counted {k * 7} gulls before breakfast.\n" for k in range(20)
)


def shoot(ui: Any, page: Any, name: str) -> None:
    ui.ARTIFACTS.mkdir(parents=True, exist_ok=True)
    size = page.viewport_size
    page.screenshot(path=str(ui.ARTIFACTS / f"tools-{name}-{size['width']}x{size['height']}.png"))


def chats(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in frames if f.get("type") == "chat"]


def define_tool(page: Any, params: str) -> None:
    """Open the editor on an empty conversation and type one function."""
    page.click("#tools-button")
    expect(page.locator("#tools-dialog")).to_be_visible()
    page.click("#tool-add")
    page.fill("#tool-name-0", "get weather")  # a space: not a function name
    expect(page.locator("#tool-err-0")).to_contain_text("the name must be 1 to 64 letters")
    expect(page.locator("#tool-name-0")).to_have_attribute("aria-invalid", "true")
    page.fill("#tool-name-0", TOOL["name"])
    page.fill("#tool-description-0", TOOL["description"])
    page.fill("#tool-parameters-0", params)
    page.select_option("#tool-choice", "required")


def close_tools(page: Any) -> None:
    page.click("#tools-dialog button.primary")
    expect(page.locator("#tools-dialog")).to_be_hidden()


def test_a_tool_from_the_editor_is_called_and_its_result_goes_back(ui_smol) -> None:
    ui = ui_smol
    page = ui.page(settings={**ui.FAST, "max_tokens": 120})
    frames = ui.record_frames(page)
    define_tool(page, '{"type": "object", "properties": {"city": ')  # not JSON yet
    expect(page.locator("#tool-err-0")).to_contain_text("its parameters schema is not valid JSON")
    close_tools(page)
    expect(page.locator("#tools-button")).to_have_class(re.compile(r"\binvalid\b"))

    # A bad schema: nothing is sent, the line says why and reopens the editor.
    ui.send(page, "Weather in Oslo?")
    refusal = page.locator("#format-error")
    expect(refusal).to_contain_text(
        "Not sent: Function “get_weather”: its parameters schema is not valid JSON"
    )
    expect(page.locator("#prompt")).to_have_value("Weather in Oslo?")
    page.wait_for_timeout(300)
    assert chats(frames) == [] and page.locator(".msg").count() == 0
    refusal.get_by_role("button", name="Edit tools").click()
    expect(page.locator("#tools-dialog")).to_be_visible()
    expect(page.locator("#tool-parameters-0")).to_be_focused()
    page.fill("#tool-parameters-0", TOOL["parameters"])
    expect(page.locator("#tool-err-0")).to_be_hidden()
    expect(refusal).to_be_hidden()
    close_tools(page)
    expect(page.locator("#tools-button")).to_have_text("Tools (1)")

    # The model must call it: the card shows the call, its arguments valid against the schema.
    page.press("#prompt", "Enter")
    ui.wait_finished(page)
    sent = chats(frames)[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": TOOL["description"], "parameters": PARAMS},
        }
    ]
    assert sent["tool_choice"] == "required"
    card = ui.last_answer(page).locator(".tool-call")
    expect(card).to_have_count(1)
    expect(card.locator(".tool-call-name")).to_have_text("get_weather")
    call_id = card.locator(".tool-call-id").text_content()
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id or "")
    args = json.loads(card.locator("pre code").text_content())
    jsonschema.validate(args, PARAMS)
    shoot(ui, page, "call")

    # The person types the result: it goes back as a tool message after the call, then the
    # model answers again (the call is required, so with another call).
    reply = ui.last_answer(page).locator("form.tool-reply")
    reply.get_by_label("Result of get_weather").fill('{"temp_c": -3, "sky": "snow"}')
    reply.get_by_role("button", name="Send result").click()
    expect(page.locator(".msg.tool .tool-result-text")).to_have_text('{"temp_c": -3, "sky": "snow"}')
    ui.wait_finished(page)
    history = chats(frames)[-1]["messages"]
    assert history[-2]["role"] == "assistant" and history[-2]["content"] is None
    assert history[-2]["tool_calls"][0]["id"] == call_id
    assert json.loads(history[-2]["tool_calls"][0]["function"]["arguments"]) == args
    assert history[-1] == {
        "role": "tool",
        "tool_call_id": call_id,
        "content": '{"temp_c": -3, "sky": "snow"}',
    }
    expect(page.locator("form.tool-reply")).to_have_count(1)  # only under the newest call
    expect(ui.last_answer(page).locator(".tool-call")).to_have_count(1)

    # Kept with the conversation: the editor and the result are there after a reload.
    page.reload()
    expect(page.locator("#tools-button")).to_have_text("Tools (1)")
    expect(page.locator(".msg.tool")).to_have_count(1)
    stored = ui.stored_conv(page)
    assert stored["tools"]["functions"][0] == TOOL and stored["tools"]["choice"] == "required"
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool", "assistant"]
    ui.assert_no_errors(page)


def test_export_and_import_keep_the_tools_and_refuse_bad_ones(ui_smol) -> None:
    ui = ui_smol
    conv = ui.conversation("ctools", "Tools", [("user", "Weather?"), ("assistant", "")])
    conv["tools"] = {"functions": [TOOL], "choice": "function", "function": "get_weather"}
    conv["messages"][1]["toolCalls"] = [
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
    conv["messages"].append(
        {"id": "ctools-m2", "role": "tool", "content": "-3", "toolCallId": "call_1", "name": "get_weather"}
    )
    conv["messages"][0]["attachments"] = [{"name": "notes.txt", "size": 3, "text": "abc"}]
    page = ui.page(convs=[conv])
    expect(page.locator("#tools-button")).to_have_text("Tools (1)")
    back = page.evaluate("""async () => {
      const io = await import('/conv-io.js');
      const { chat, store } = window.wsllm;
      return io.parseConversations(io.toJson([chat.get(store.activeId)]));
    }""")
    assert back[0]["tools"] == conv["tools"] and back[0]["messages"] == conv["messages"]

    # Each bad file: what it holds, and what the message says.
    user_file = {"id": "m", "role": "user", "content": "", "attachments": [{"name": "a.txt"}]}
    bad = [
        ({"tools": {"functions": [TOOL], "choice": "maybe"}}, '"tools.choice" must be one of'),
        ({"tools": {"functions": ["get_weather"]}}, "tool function 1 is not an object"),
        (
            {"tools": {"functions": [{"name": "f", "parameters": PARAMS}]}},
            '"parameters" of tool function 1 must be a text',
        ),
        ({"messages": [{"id": "m", "role": "tool", "content": "-3"}]}, 'a tool result needs "toolCallId"'),
        ({"messages": [user_file]}, '"attachments" 1 must be an object whose "name", "text" are texts'),
    ]
    page.click("#open-data")
    for change, says in bad:
        c = {**conv, **change, "id": "cbad"}
        page.set_input_files(
            "#import-file",
            {"name": "bad.json", "mimeType": "application/json", "buffer": json.dumps([c]).encode()},
        )
        expect(page.locator("#import-status")).to_contain_text(says)
        expect(page.locator("#import-status")).to_contain_text("Nothing was imported. Conversation 1")
        assert page.evaluate("() => localStorage.getItem('wsllm.v1.conv.cbad')") is None, says
    ui.assert_no_errors(page)


def test_an_attached_text_file_reaches_the_prompt(ui_smol, smollm_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    ui = ui_smol
    page = ui.page(settings={**ui.FAST, "max_tokens": 8, "attach_kb": 2})
    frames = ui.record_frames(page)
    ui.send(page, "Summarize this.")
    ui.wait_finished(page)
    plain = ui.stored_conv(page)["messages"][-1]["usage"]["prompt_tokens"]

    page.click("#new-chat")
    big = tmp_path / "big.log"
    big.write_text("x" * 2500)
    page.set_input_files("#attach-file", str(big))  # past the cap of 2 kB
    expect(page.locator("#attach-error")).to_have_text(
        "“big.log” is 2.5 kB: a file may be at most 2 kB (Settings, “Largest attached file”)."
    )
    notes, other = tmp_path / "notes.txt", tmp_path / "other.md"
    notes.write_text(NOTES)
    other.write_text("# not this one\n")
    page.set_input_files("#attach-file", [str(notes), str(other)])
    chips = page.locator("#attach-chips .chip")
    expect(chips).to_have_count(2)
    expect(chips.first).to_contain_text("notes.txt")
    expect(chips.first).to_contain_text(f"{len(NOTES) / 1000:.1f} kB")
    page.get_by_role("button", name="Remove other.md").click()  # removable before sending
    expect(chips).to_have_count(1)
    ui.send(page, "Summarize this.")
    ui.wait_finished(page)
    expect(page.locator("#attach-chips .chip")).to_have_count(0)  # sent: the composer is empty again
    expect(page.locator(".msg.user .msg-files .chip")).to_have_text([re.compile(r"^notes\.txt")])

    # The file is in the message as a fenced block, and the prompt grew by its tokens.
    content = chats(frames)[-1]["messages"][-1]["content"]
    assert content == f"Summarize this.\n\nFile “notes.txt”:\n```txt\n{NOTES}```"
    grown = ui.stored_conv(page)["messages"][-1]["usage"]["prompt_tokens"] - plain
    file_tokens = len(AutoTokenizer.from_pretrained(str(smollm_dir))(NOTES)["input_ids"])
    assert file_tokens > 300
    assert file_tokens <= grown <= file_tokens + 30, (grown, file_tokens)  # + the name and the fences

    page.reload()
    expect(page.locator(".msg.user .msg-files .chip")).to_have_text([re.compile(r"^notes\.txt")])
    assert ui.stored_conv(page)["messages"][0]["attachments"] == [
        {"name": "notes.txt", "size": len(NOTES), "text": NOTES}
    ]
    ui.assert_no_errors(page)


@pytest.mark.parametrize("size", SIZES, ids=["phone", "desktop"])
def test_editor_and_chips_fit_and_pass_axe(ui_smol, size: tuple[int, int], tmp_path: Path) -> None:
    ui = ui_smol
    conv = ui.conversation(
        "cshow", "Tools and files", [("user", "Weather, and read this."), ("assistant", "")]
    )
    conv["tools"] = {
        "functions": [TOOL, {"name": "get time", "description": "", "parameters": ""}],
        "choice": "required",
    }
    conv["messages"][0]["attachments"] = [
        {"name": "a-file-with-a-rather-long-name-for-a-phone.txt", "size": 3, "text": "abc"}
    ]
    conv["messages"][1]["toolCalls"] = [
        {"id": "call_0123456789abcdef01234567", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
    (tmp_path / "notes.txt").write_text(NOTES)
    for scheme in ("light", "dark"):
        page = ui.page(
            size, scheme, convs=[conv], bypass_csp=True
        )  # axe is injected: the CSP would refuse it
        page.set_input_files("#attach-file", str(tmp_path / "notes.txt"))
        expect(page.locator("#attach-chips .chip")).to_have_count(1)
        expect(page.locator("form.tool-reply")).to_be_visible()
        shoot(ui, page, f"page-{scheme}")
        assert page.evaluate(
            "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )
        assert ui.axe_serious(page) == [], (size, scheme, "page")
        page.click("#tools-button")
        expect(page.locator("#tool-err-1")).to_be_visible()  # "get time": a problem shown
        shoot(ui, page, f"editor-{scheme}")
        assert page.evaluate(
            "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )
        assert ui.axe_serious(page) == [], (size, scheme, "editor")
        ui.assert_no_errors(page)
        page.context.close()
