"""The chat UI's controls (issue 15, acceptance 1, 5 and 6): the model picker on a server
with two models (checked on the server's own per-model counter), export and import of
conversations (exact round trip; a corrupt file changes nothing), no sideways overflow
and no serious axe-core violation at phone and desktop sizes in both themes, plus the
settings' bounds from the hello, search, deleting a message, and the error messages.
Fixtures: tests/e2e/conftest.py (`two_model_server` starts only for the tests that use `ui2`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

AXE = Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js"
SIZES = [(390, 844), (1280, 800)]
WORDS = re.compile(r"^( ?w\d+)*$")  # all the text the word model can write
A, B = "tiny-llama", "tiny-words"
BOB = {"max_tokens": 24, "temperature": 0, "top_p": 1, "api_key": "sk-bob"}
ALICE = {**BOB, "api_key": "sk-alice"}

CONV_KEYS = """() => Object.fromEntries(Object.keys(localStorage)
  .filter((k) => k.startsWith('wsllm.v1.conv.')).map((k) => [k, localStorage.getItem(k)]))"""
ALL_KEYS = "() => Object.fromEntries(Object.keys(localStorage).map((k) => [k, localStorage.getItem(k)]))"


def tenant_requests(server: Any, tenant: str, model: str) -> float:
    return float(server.metric(f'wsllm_tenant_requests_total{{model="{model}",tenant="{tenant}"}}'))


def stored_conv(page: Any) -> dict[str, Any]:
    return page.evaluate("JSON.parse(localStorage.getItem('wsllm.v1.conv.' + wsllm.store.activeId))")


def settings_of(page: Any) -> dict[str, Any]:
    return page.evaluate("JSON.parse(localStorage.getItem('wsllm.v1.settings'))")


# ---- acceptance 1: two models -------------------------------------------------------


def test_the_picker_lists_both_models_and_the_message_goes_to_the_picked_one(ui2) -> None:
    server = ui2.server
    gone = ui2.conversation("cgone", "Old chat", [("user", "hi"), ("assistant", "w1 w2")])
    gone["model"] = "retired-model"
    page = ui2.page(settings=BOB, convs=[ui2.conversation("cnew", "New", [])])
    picker = page.locator("#model-picker")
    expect(picker.locator("option")).to_have_count(3)
    values = picker.locator("option").evaluate_all("(os) => os.map((o) => [o.value, o.textContent])")
    assert [v for v, _ in values] == ["", A, B]
    assert values[0][1].startswith(f"Server default ({A})")
    assert all("2,048-token context" in text for _, text in values), values

    before = {m: tenant_requests(server, "bob", m) for m in (A, B)}
    picker.select_option(B)
    ui2.send(page, "Hello, words.")
    ui2.wait_finished(page)
    answer = ui2.last_answer(page)
    assert WORDS.match(answer.locator(".msg-body").inner_text().strip())  # only the word model writes this
    after = {m: tenant_requests(server, "bob", m) for m in (A, B)}
    assert after == {A: before[A], B: before[B] + 1}, (before, after)
    conv = stored_conv(page)
    assert conv["model"] == B and conv["messages"][1]["model"] == B
    usage = conv["messages"][1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0

    # The context meter: that usage against the model's context, with a label.
    meter = page.locator("#ctx-meter")
    expect(page.locator("#ctx .ctx-text")).to_have_text(f"{usage['total_tokens']} / 2,048 tokens")
    expect(meter).to_have_attribute(
        "aria-label", re.compile(rf"^Context used: {usage['total_tokens']} of 2,048 tokens")
    )
    assert page.evaluate("document.getElementById('ctx-meter').value") == usage["total_tokens"]

    # A new chat starts with the model picked last; each chat keeps its own.
    page.click("#new-chat")
    expect(picker).to_have_value(B)
    picker.select_option(A)
    ui2.send(page, "Hello, llama.")
    ui2.wait_finished(page)
    assert tenant_requests(server, "bob", A) == before[A] + 1
    page.click(".conv-item:has-text('Hello, words.') .conv-select")
    expect(picker).to_have_value(B)
    assert settings_of(page)["model"] == A  # the last picked

    # A stored model that is no longer served: said, and the server's default is used.
    page2 = ui2.page(settings=BOB, convs=[gone])
    expect(page2.locator("#model-notice")).to_contain_text(
        "“retired-model” that this chat used is no longer served"
    )
    expect(page2.locator("#model-picker")).to_have_value("")
    assert stored_conv(page2)["model"] == ""
    ui2.send(page2, "Still there?")
    ui2.wait_finished(page2)
    assert tenant_requests(server, "bob", A) == before[A] + 2  # the default model
    ui2.assert_no_errors(page)
    ui2.assert_no_errors(page2)


def test_settings_take_their_bounds_from_the_hello_and_reach_the_server(ui2) -> None:
    page = ui2.page(settings=BOB)
    sent: list[dict[str, Any]] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda f: sent.append(json.loads(f))))
    page.reload()  # a socket opened after the listener
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
    page.click("#open-settings")
    max_tokens = page.locator("#set-max-tokens")
    expect(max_tokens).to_have_attribute("max", "2000")  # --max-tokens-limit 2000, not the default 4096
    expect(page.locator("#max-tokens-limit")).to_have_text("(server max 2,000)")
    expect(page.locator("#stop-limit")).to_have_text("(at most 3)")

    max_tokens.fill("2001")
    expect(page.locator("#err-max-tokens")).to_have_text(
        "Max tokens must be a whole number from 1 to 2,000 (the server's limit). Not saved."
    )
    expect(max_tokens).to_have_attribute("aria-invalid", "true")
    assert settings_of(page)["max_tokens"] == 24
    max_tokens.fill("20")
    expect(page.locator("#err-max-tokens")).to_be_hidden()
    expect(max_tokens).not_to_have_attribute("aria-invalid", "true")

    checks = {
        "top-k": ("1.5", "Top k must be a whole number from -1 to 1,048,576."),
        "min-p": ("1.2", "Min p must be a number from 0 to 1."),
        "presence-penalty": ("-3", "Presence penalty must be a number from -2 to 2."),
        "repetition-penalty": ("0", "Repetition penalty must be a number above 0 and at most 2."),
        "seed": ("-1", "Seed must be a whole number from 0 to 9,007,199,254,740,991."),
    }
    for field, (bad, message) in checks.items():
        page.fill(f"#set-{field}", bad)
        expect(page.locator(f"#err-{field}")).to_have_text(f"{message} Not saved.")
    page.fill("#set-stop", "a\nb\nc\nd")
    expect(page.locator("#err-stop")).to_contain_text(
        "At most 3 stop strings (the server's limit); there are 4."
    )
    assert settings_of(page)["stop"] == []

    good = {"top-k": "40", "min-p": "0.05", "presence-penalty": "0.5", "frequency-penalty": "-0.5",
            "repetition-penalty": "1.1", "seed": "7"}  # fmt: skip
    for field, value in good.items():
        page.fill(f"#set-{field}", value)
        expect(page.locator(f"#err-{field}")).to_be_hidden()
    page.fill("#set-stop", "w999\\n\\nEND\n\\\\")
    expect(page.locator("#err-stop")).to_be_hidden()
    s = settings_of(page)
    assert s["stop"] == ["w999\n\nEND", "\\"]
    assert (s["top_k"], s["min_p"], s["repetition_penalty"], s["seed"], s["max_tokens"]) == (
        40,
        0.05,
        1.1,
        7,
        20,
    )
    page.click("#settings-dialog button.primary")

    ui2.send(page, "With every setting.")
    ui2.wait_finished(page)
    chat = [m for m in sent if m.get("type") == "chat"][-1]
    assert {k: chat.get(k) for k in ("top_k", "min_p", "presence_penalty", "frequency_penalty")} == {
        "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5}  # fmt: skip
    assert (chat["repetition_penalty"], chat["seed"], chat["max_tokens"]) == (1.1, 7, 20)
    assert chat["stop"] == ["w999\n\nEND", "\\"]
    expect(ui2.last_answer(page)).to_have_attribute("data-status", "done")  # the server took them

    # Reset: the optional ones are empty again and are not sent.
    page.click("#open-settings")
    page.click("#settings-reset")
    expect(page.locator("#set-top-k")).to_have_value("")
    expect(page.locator("#set-stop")).to_have_value("")
    page.click("#settings-dialog button.primary")
    ui2.send(page, "Plain again.")
    ui2.wait_finished(page)
    chat = [m for m in sent if m.get("type") == "chat"][-1]
    assert not {"top_k", "min_p", "stop", "seed", "repetition_penalty"} & set(chat), chat
    ui2.assert_no_errors(page)


# ---- errors -------------------------------------------------------------------------


def test_each_error_gets_a_sentence_a_person_understands(ui2) -> None:
    long = {**ALICE, "max_tokens": 1500}
    # rate_limited (alice may have one request in flight): says when to retry.
    page = ui2.page(settings=long)
    ui2.send(page, "A long answer, please.")
    expect(ui2.last_answer(page)).to_have_attribute("data-status", "streaming", timeout=15_000)
    page.click("#new-chat")
    ui2.send(page, "And another at once.")
    error = ui2.last_answer(page).locator(".msg-error")
    expect(error).to_contain_text(
        re.compile(r"request limit of this API key\. Try again in 1 s \(at \d\d:\d\d:\d\d\)")
    )
    page.click(".conv-item:has-text('A long answer') .conv-select")
    page.keyboard.press("Escape")
    page.context.close()

    # queue_timeout: one sequence per engine; a second request waits 0.3 s, then leaves.
    page = ui2.page(settings={**BOB, "max_tokens": 2000})
    ui2.send(page, "Keep the engine busy.")
    expect(ui2.last_answer(page)).to_have_attribute("data-status", "streaming", timeout=15_000)
    page.click("#new-chat")
    ui2.send(page, "Wait in the queue.")
    expect(ui2.last_answer(page).locator(".msg-error")).to_contain_text(
        re.compile(r"The server was too busy to start this answer in time .*Try again in 1 s \(at "),
        timeout=10_000,
    )

    # A lost connection: the memory broker cannot resume the answer. A fresh long answer
    # once the first is stopped (the engine runs one at a time).
    page.click(".conv-item:has-text('Keep the engine busy') .conv-select")
    page.keyboard.press("Escape")
    expect(ui2.last_answer(page)).to_have_attribute("data-status", "stopped")
    page.click("#new-chat")
    ui2.send(page, "Another long answer.")
    answer = ui2.last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming", timeout=15_000)
    page.evaluate("wsllm.ws._ws.close()")
    expect(answer).to_have_attribute("data-status", "interrupted", timeout=15_000)
    expect(answer.locator(".msg-error")).to_contain_text(
        "The connection to the server was lost and the server could not resume this answer."
    )
    page.context.close()

    # model_not_found: the list named a model the server does not serve (it was
    # listed once, then went away): said, and the chat falls back to the default.
    page = ui2.page(settings=BOB, connected=False)
    served = {"n": 0}

    def add_ghost(route: Any) -> None:
        body = route.fetch().json()
        served["n"] += 1
        if served["n"] == 1:
            body["data"].append({"id": "ghost", "object": "model", "max_model_len": 512})
        route.fulfill(json=body)

    page.route("**/v1/models", add_ghost)
    page.reload()
    expect(page.locator("#model-picker option[value=ghost]")).to_have_count(1, timeout=15_000)
    page.select_option("#model-picker", "ghost")
    expect(page.locator("#ctx .ctx-text")).to_have_text("– / 512 tokens")  # that model's context
    ui2.send(page, "Hello, ghost?")
    expect(ui2.last_answer(page).locator(".msg-error")).to_contain_text(
        "The server does not serve “ghost” (any more)."
    )
    expect(page.locator("#model-notice")).to_contain_text("“ghost” that this chat used is no longer served")
    expect(page.locator("#model-picker")).to_have_value("")
    ui2.assert_no_errors(page)


def test_error_sentences_for_the_other_codes(ui) -> None:
    page = ui.page()
    said = page.evaluate("""async () => {
      const { describeError, retryWhen } = await import('/errors.js');
      const codes = ['queue_full', 'engine_busy', 'model_not_ready', 'context_length_exceeded',
                     'slow_consumer', 'resumed_elsewhere', 'worker_lost', 'engine_stalled', 'internal_error'];
      return {codes: Object.fromEntries(codes.map((c) => [c, describeError(c, 'detail')])),
              later: retryWhen(150, Date.UTC(2026, 0, 1, 12, 0, 0)),
              unknown: describeError('brand_new', 'what the server said')};
    }""")
    assert all(text.endswith("(detail)") or "another tab" in text for text in said["codes"].values()), said
    assert len(set(said["codes"].values())) == len(said["codes"])  # each its own sentence
    assert said["codes"]["context_length_exceeded"].startswith(
        "This conversation no longer fits the model's context"
    )
    assert re.fullmatch(r"in 3 min \(at \d\d:\d\d:\d\d\)", said["later"])
    assert said["unknown"] == "what the server said"


# ---- acceptance 5: export and import ------------------------------------------------


def three_conversations(ui) -> list[dict[str, Any]]:
    rich = ui.conversation(
        "crich", "Rich fields", [("user", "Explain."), ("assistant", "## Because\n\n- one")]
    )
    rich["system"] = "Be brief."
    rich["model"] = ""
    rich["output"] = {"mode": "text", "schema": '{"type": "object"}', "regex": ""}  # ui-render's
    rich["futureField"] = {"nested": [1, 2.5, None, True, "ü"]}  # a field this version does not know
    a = rich["messages"][1]
    a.update(usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13, "cached_tokens": 0},
             reasoning="Thinking…", toolCalls=[{"id": "c1", "name": "f", "arguments": "{}"}],
             stats={"ttftMs": 12.5, "tokens": 4, "tps": 30.1}, finishReason="stop", model=A)  # fmt: skip
    plain = ui.conversation("cplain", "Plain “quotes” & <tags>", [("user", "x" * 300), ("assistant", "y")])
    empty = ui.conversation("cempty", "No messages yet", [])
    return [rich, plain, empty]


def test_export_then_import_restores_conversations_exactly_and_bad_files_change_nothing(ui, tmp_path) -> None:
    page = ui.page(convs=three_conversations(ui))
    ui.send(page, "A real answer too.")  # the seeded first conversation gets a real one
    ui.wait_finished(page)
    before = page.evaluate(CONV_KEYS)
    assert len(before) == 3

    page.click("#open-data")
    with page.expect_download() as dl:
        page.click("#export-all-json")
    all_json = tmp_path / "all.json"
    dl.value.save_as(all_json)
    assert re.fullmatch(r"wsllm-conversations-\d{4}-\d\d-\d\d\.json", dl.value.suggested_filename)
    body = json.loads(all_json.read_text())
    assert body["format"] == "wsllm-conversations" and len(body["conversations"]) == 3
    with page.expect_download() as dl:
        page.click("#export-all-md")
    md = Path(dl.value.path()).read_text()
    assert dl.value.suggested_filename.endswith(".md")
    for title in (
        "# Rich fields",
        "# Plain “quotes” & <tags>",
        "# No messages yet",
        "## You",
        "A real answer too.",
    ):
        assert title in md
    with page.expect_download() as dl:
        page.click("#export-one-json")
    assert dl.value.suggested_filename.startswith("wsllm-rich-fields-")
    assert [c["id"] for c in json.loads(Path(dl.value.path()).read_text())["conversations"]] == ["crich"]
    page.screenshot(path=str(ui.ARTIFACTS / "controls-1280x800-export.png"))

    # Clear everything; the page starts with one blank chat; import the file.
    page.evaluate("localStorage.clear()")
    page.reload()
    expect(page.locator(".conv-item")).to_have_count(1)
    blank = page.evaluate(CONV_KEYS)
    page.click("#open-data")
    page.set_input_files("#import-file", str(all_json))
    expect(page.locator("#import-status")).to_have_text("Imported 3 conversations.")
    after = page.evaluate(CONV_KEYS)
    assert {k: v for k, v in after.items() if k not in blank} == before  # the same text, byte for byte
    expect(page.locator(".conv-item")).to_have_count(4)
    page.reload()  # and the app reads them back
    page.click(".conv-item:has-text('Rich fields') .conv-select")
    expect(page.locator(".msg")).to_have_count(4)
    assert page.evaluate(CONV_KEYS) == after

    # Again: nothing new, nothing overwritten.
    page.click("#open-data")
    page.set_input_files("#import-file", str(all_json))
    expect(page.locator("#import-status")).to_have_text("3 conversations were already here.")
    assert page.evaluate(CONV_KEYS) == after

    # Bad files: a clear message, and storage stays exactly as it was.
    good = body["conversations"][1] | {"id": "cnew"}
    bad_files = {
        "broken.json": (
            '{"format": "wsllm-conversations", "conversations": [',
            "This file is not valid JSON",
        ),
        "shape.json": (
            json.dumps({"hello": "world"}),
            "This is JSON, but not conversations exported from wsllm.",
        ),
        "role.json": (
            json.dumps(
                {
                    "format": "wsllm-conversations",
                    "version": 1,
                    "conversations": [
                        good,
                        {
                            "id": "cbad",
                            "title": "Bad",
                            "messages": [{"id": "m1", "role": "wizard", "content": "hi"}],
                        },
                    ],
                }
            ),
            'Conversation 2 (“Bad”), message 1: "role" must be "user", "assistant" or "tool"',
        ),  # fmt: skip
        "content.json": (
            json.dumps([{"id": "c", "title": "t", "messages": [{"id": "m", "role": "user"}]}]),
            'Conversation 1 (“t”), message 1: "content" must be a text',
        ),  # fmt: skip
        "empty.json": (
            json.dumps({"format": "wsllm-conversations", "version": 1, "conversations": []}),
            "This file holds no conversations.",
        ),  # fmt: skip
    }
    everything = page.evaluate(ALL_KEYS)
    status = page.locator("#import-status")
    for name, (text, message) in bad_files.items():
        path = tmp_path / name
        path.write_text(text)
        page.set_input_files("#import-file", str(path))
        expect(status).to_contain_text(f"Nothing was imported. {message}")
        expect(status).to_have_class(re.compile("error"))
        assert page.evaluate(ALL_KEYS) == everything, name
    expect(page.locator(".conv-item")).to_have_count(4)
    ui.assert_no_errors(page)


# ---- search and delete --------------------------------------------------------------


def test_search_finds_titles_and_message_text(ui) -> None:
    convs = [
        ui.conversation("c1", "Trip to Paris", [("user", "What to see?"), ("assistant", "The Louvre.")]),
        ui.conversation(
            "c2",
            "Desserts",
            [("user", "A recipe, please."), ("assistant", "Crème brûlée: cream, eggs, sugar.")],
        ),
        ui.conversation("c3", "Unrelated", [("user", "Weather in Oslo?"), ("assistant", "Cold.")]),
    ]
    page = ui.page(convs=convs)
    search = page.get_by_label("Search conversations")
    titles = page.locator(".conv-item .conv-title-text")
    search.fill("creme")  # accents and case do not matter
    expect(titles).to_have_text(["Desserts"])
    expect(page.locator(".conv-snippet")).to_contain_text("Crème brûlée")
    expect(page.locator("#search-status")).to_have_text("1 conversation matches")
    search.fill("paris")
    expect(titles).to_have_text(["Trip to Paris"])
    search.fill("oslo cold")  # every word, anywhere in the conversation
    expect(titles).to_have_text(["Unrelated"])
    search.fill("zebra")
    expect(titles).to_have_count(0)
    expect(page.locator(".conv-empty")).to_have_text("No conversation matches.")
    search.press("Escape")
    expect(search).to_have_value("")
    expect(titles).to_have_count(3)
    ui.assert_no_errors(page)


def test_delete_one_message_takes_its_answer_with_it(ui) -> None:
    conv = ui.conversation(
        "cdel", "Deleting", [("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")]
    )
    page = ui.page(convs=[conv])
    first = page.locator(".msg.user").first
    first.get_by_role("button", name="Delete this message and its answer").click()
    confirm = first.get_by_role("button", name="Press again to delete this message and its answer")
    expect(confirm).to_be_focused()
    expect(page.locator(".msg")).to_have_count(4)  # one press only asks
    confirm.click()
    expect(page.locator(".msg .msg-body")).to_have_text(["Q2", "A2"])
    answer = ui.last_answer(page)
    answer.get_by_role("button", name="Delete this answer").click()
    answer.get_by_role("button", name="Press again to delete this answer").click()
    expect(page.locator(".msg .msg-body")).to_have_text(["Q2"])
    page.reload()
    expect(page.locator(".msg .msg-body")).to_have_text(["Q2"])
    assert [m["content"] for m in stored_conv(page)["messages"]] == ["Q2"]
    ui.assert_no_errors(page)


# ---- acceptance 6: layout and accessibility -----------------------------------------

OVERFLOW = "() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]"


def axe_serious(page: Any) -> list[str]:
    """Violations of impact serious or critical, as `rule: target` lines."""
    if not page.evaluate("typeof axe !== 'undefined'"):
        page.add_script_tag(path=str(AXE))
    found = page.evaluate("""async () => {
      const r = await axe.run(document, {resultTypes: ['violations']});
      return r.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical')
        .flatMap((v) => v.nodes.map((n) => `${v.id}: ${n.target.join(' ')} (${n.failureSummary})`));
    }""")
    return list(found)


def assert_fits(page: Any, where: str) -> None:
    scroll, client = page.evaluate(OVERFLOW)
    assert scroll <= client, (where, scroll, client)


@pytest.mark.parametrize("size", SIZES, ids=["phone", "desktop"])
def test_no_sideways_overflow_and_no_serious_axe_violation(ui, size: tuple[int, int]) -> None:
    ui.ARTIFACTS.mkdir(parents=True, exist_ok=True)
    long_title = "A conversation whose title is long enough to be cut in the sidebar and the top bar"
    conv = ui.conversation(
        "cwide",
        long_title,
        [("user", "Show me " + "wide " * 40), ("assistant", "Some `code` and " + "z" * 200)],
    )
    conv["messages"][1]["usage"] = {"prompt_tokens": 1500, "completion_tokens": 200, "total_tokens": 1700}
    phone = size[0] < 760
    for scheme in ("light", "dark"):
        page = ui.page(
            size, scheme, convs=[conv], bypass_csp=True
        )  # axe is injected: the CSP would refuse it
        name = f"controls-{size[0]}x{size[1]}-{scheme}"
        expect(page.locator("#ctx .ctx-text")).to_contain_text("1,700 / 2,048")
        if phone:  # the conversation list is a drawer
            page.click("#open-sidebar")
            page.wait_for_timeout(250)  # its slide-in
        page.get_by_label("Search conversations").fill("wide")
        expect(page.locator(".conv-snippet")).to_have_count(1)
        page.screenshot(path=str(ui.ARTIFACTS / f"{name}{'-sidebar' if phone else ''}.png"))
        assert_fits(page, "page")
        assert axe_serious(page) == [], (name, "page")

        page.click("#open-data")
        page.set_input_files(
            "#import-file", {"name": "x.json", "mimeType": "application/json", "buffer": b"{oops"}
        )
        expect(page.locator("#import-status")).to_contain_text("Nothing was imported")
        page.screenshot(path=str(ui.ARTIFACTS / f"{name}-export.png"))
        assert_fits(page, "export dialog")
        assert axe_serious(page) == [], (name, "export dialog")
        page.keyboard.press("Escape")
        expect(page.locator("#data-dialog")).to_be_hidden()
        if phone:
            page.keyboard.press("Escape")  # closes the drawer
            expect(page.locator("#sidebar")).not_to_be_in_viewport()
            page.screenshot(path=str(ui.ARTIFACTS / f"{name}.png"))
            assert_fits(page, "page")
            assert axe_serious(page) == [], (name, "page")

        page.click("#open-settings")
        page.fill("#set-max-tokens", "999999")  # shows its message
        expect(page.locator("#err-max-tokens")).to_be_visible()
        page.screenshot(path=str(ui.ARTIFACTS / f"{name}-settings.png"))
        assert_fits(page, "settings dialog")
        assert axe_serious(page) == [], (name, "settings dialog")
        ui.assert_no_errors(page)
        page.context.close()
