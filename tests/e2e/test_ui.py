"""The browser chat UI (frontend/) in Debian's chromium, driven by Playwright, against a
live `wsllm serve` with a tiny random-weight model (issue 7's acceptance list).

The server runs as a subprocess on a free port so that the reconnect test can stop it
and start it again on the same port. Screenshots go to tests/artifacts/ (git-ignored).
Set WSLLM_UI_SERVER_CMD (a command with {port} and {model} placeholders) to run these
tests against another server, e.g. one on the Redis broker.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("playwright.sync_api")
from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]


# ---- the live server ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (local test server)
        return r.status, r.read()


class ServerProcess:
    """`wsllm serve` as a child process that can be stopped and started on one port."""

    def __init__(self, model: Path, port: int, log: Path) -> None:
        self.model, self.port, self.log = model, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        custom = os.environ.get("WSLLM_UI_SERVER_CMD")
        if custom:
            return shlex.split(custom.format(port=self.port, model=self.model))
        exe = shutil.which("wsllm", path=str(Path(sys.executable).parent)) or "wsllm"
        return [exe, "serve", "--model", str(self.model), "--port", str(self.port),
                "--kv-cache-gb", "0.05", "--threads", "1"]  # fmt: skip

    def start(self, timeout: float = 120.0) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if http_get(f"{self.url}/v1/models")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def metric(self, prefix: str) -> float:
        """Sum of the Prometheus samples whose line starts with `prefix`."""
        body = http_get(f"{self.url}/metrics")[1].decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_model_dir, free_port(), tmp_path_factory.mktemp("ui-server") / "server.log")
    srv.start()
    yield srv
    srv.stop()


# ---- the browser ----------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        b.close()


def seed_storage(settings: dict[str, Any] | None = None, convs: list[dict[str, Any]] | None = None) -> str:
    """An init script that fills localStorage once per context (not again on reload)."""
    items = {"wsllm.v1.settings": settings or {}}
    for c in convs or []:
        items[f"wsllm.v1.conv.{c['id']}"] = c
    if convs:
        items["wsllm.v1.active"] = convs[0]["id"]
    return (
        "if (!sessionStorage.getItem('seeded')) { sessionStorage.setItem('seeded', '1');"
        f" for (const [k, v] of Object.entries({json.dumps(items)})) localStorage.setItem(k, JSON.stringify(v)); }}"
    )


# Short, deterministic answers: greedy decoding of the tiny random model.
FAST = {"max_tokens": 24, "temperature": 0, "top_p": 1}


def open_page(
    browser: Browser,
    server: ServerProcess,
    size: tuple[int, int] = (1280, 800),
    scheme: str = "light",
    **seed: Any,
) -> Page:
    ctx = browser.new_context(viewport={"width": size[0], "height": size[1]}, color_scheme=scheme)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.errors = errors  # type: ignore[attr-defined]
    page.add_init_script(seed_storage(seed.get("settings", FAST), seed.get("convs")))
    page.goto(server.url + "/")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
    return page


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page: Page) -> Any:
    return page.locator(".msg.assistant").last


def wait_finished(page: Page, timeout: float = 30_000) -> None:
    expect(last_answer(page)).to_have_attribute("data-status", re.compile("done|stopped"), timeout=timeout)


def no_page_errors(page: Page, allow: str = "favicon") -> None:
    errors = [e for e in page.errors if not re.search(allow, e)]  # type: ignore[attr-defined]
    assert not errors, errors


def wait_until(fn: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def open_settings(page: Page, **values: str) -> None:
    page.click("#open-settings")
    for key, value in values.items():
        page.fill(f"#set-{key.replace('_', '-')}", value)
    page.click("#settings-dialog button.primary")
    expect(page.locator("#settings-dialog")).to_be_hidden()


# ---- 1. streaming ---------------------------------------------------------------


def test_answer_streams_in_several_updates_and_shows_figures(browser: Browser, server: ServerProcess) -> None:
    page = open_page(browser, server, settings={**FAST, "max_tokens": 64})
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
    wait_finished(page)
    assert page.evaluate("[...window.__lengths].filter((n) => n > 0).length") >= 3

    answer = last_answer(page)
    expect(answer.locator(".msg-body")).not_to_be_empty()
    expect(answer.locator("[data-testid=ttft]")).to_have_text(re.compile(r"^TTFT \d+(\.\d+)? m?s$"))
    expect(answer.locator("[data-testid=tps]")).to_have_text(re.compile(r"^\d+\.\d tok/s$"))
    tokens = int(answer.locator("[data-testid=tokens]").inner_text().split()[0])
    assert 1 <= tokens <= 64
    if answer.locator("[data-testid=finish]").count():  # stopped at max_tokens
        assert tokens == 64
    expect(page.locator("#send")).to_be_visible()
    no_page_errors(page)
    page.context.close()


# ---- 2. stop, and two conversations at once ---------------------------------------


def test_stop_aborts_on_the_server_and_the_ui_sends_again(browser: Browser, server: ServerProcess) -> None:
    page = open_page(browser, server, settings={**FAST, "max_tokens": 1500})
    aborts = server.metric("wsllm_request_aborts_total")
    send(page, "Count to a thousand.")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming", timeout=15_000)
    # The engine reports what it runs in its heartbeats, which /metrics shows.
    running = "wsllm_num_requests_running"
    wait_until(lambda: server.metric(running) >= 1, what="the engine to report the request running")
    page.click("#stop")
    expect(answer).to_have_attribute("data-status", "stopped")
    text = answer.locator(".msg-body").inner_text()
    expect(answer.locator("[data-testid=finish]")).to_have_text("stopped")
    wait_until(
        lambda: server.metric("wsllm_request_aborts_total") > aborts, what="the gateway to count the abort"
    )
    wait_until(lambda: server.metric(running) == 0, what="the engine to drop the aborted request")
    page.wait_for_timeout(300)
    assert answer.locator(".msg-body").inner_text() == text, "text kept coming after stop"

    # At once: no waiting for the server's answer to the cancel.
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    open_settings(page, max_tokens="12")
    send(page, "Now something short.")
    expect(page.locator(".msg.assistant")).to_have_count(2)
    wait_finished(page)
    expect(last_answer(page)).to_have_attribute("data-status", "done")
    no_page_errors(page)
    page.context.close()


def test_two_conversations_stream_at_once_and_esc_stops(browser: Browser, server: ServerProcess) -> None:
    page = open_page(browser, server, settings={**FAST, "max_tokens": 1500})
    send(page, "A long answer, please.")
    expect(last_answer(page)).to_have_attribute("data-status", "streaming", timeout=15_000)
    first = page.locator(".conv-item.active").get_attribute("data-id")

    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    open_settings(page, max_tokens="12")
    send(page, "And a short one here.")
    wait_finished(page)
    # The first conversation is still answering meanwhile.
    expect(page.locator(f'.conv-item[data-id="{first}"] .live-dot')).to_be_visible()

    page.click(f'.conv-item[data-id="{first}"] .conv-select')
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming")
    page.keyboard.press("Escape")
    expect(answer).to_have_attribute("data-status", "stopped")
    expect(page.locator(".live-dot")).to_have_count(0)
    no_page_errors(page)
    page.context.close()


def test_server_errors_show_as_readable_messages(browser: Browser, server: ServerProcess) -> None:
    page = open_page(browser, server, settings={**FAST, "max_tokens": 1_000_000})
    send(page, "Hello?")
    error = last_answer(page).locator(".msg-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("max_tokens")
    expect(last_answer(page)).to_have_attribute("data-status", "error")
    expect(page.locator("#send")).to_be_visible()  # not stuck
    page.context.close()


# ---- 3. model text is inert ---------------------------------------------------------

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


def conversation(cid: str, title: str, messages: list[tuple[str, str]], system: str = "") -> dict[str, Any]:
    now = int(time.time() * 1000)
    return {
        "id": cid,
        "title": title,
        "system": system,
        "createdAt": now,
        "updatedAt": now,
        "messages": [
            {"id": f"{cid}-m{k}", "role": role, "content": text, "status": "done"}
            for k, (role, text) in enumerate(messages)
        ],
    }


def test_stored_hostile_markup_renders_inert(browser: Browser, server: ServerProcess) -> None:
    conv = conversation(
        "cxss", "<img src=x onerror=window.__pwned=10>", [("user", HOSTILE), ("assistant", HOSTILE)]
    )
    ctx = browser.new_context()
    requests: list[str] = []
    ctx.on("request", lambda r: requests.append(r.url))
    page = ctx.new_page()
    page.add_init_script(seed_storage(FAST, [conv]))
    page.goto(server.url + "/")
    answer = last_answer(page)
    expect(answer.locator(".msg-body")).to_contain_text('<img src=x onerror="window.__pwned = 1">')
    expect(answer.locator(".msg-body")).to_contain_text("<script>window.__pwned = 2</script>")
    page.wait_for_timeout(300)  # time for any error/load handler to have fired

    assert page.evaluate("window.__pwned") is None
    found = page.evaluate("""() => {
      const all = [...document.querySelectorAll('#messages *, #conv-list *, #conv-title *')];
      const bad = all.filter((el) => /^(img|script|iframe|object|embed|video|audio|form|style|link|details)$/i
        .test(el.tagName));
      const handlers = all.filter((el) =>
        [...el.attributes].some((a) => a.name.startsWith('on') || /^\\s*(javascript|data):/i.test(a.value)));
      const links = [...document.querySelectorAll('.msg.assistant a')].map((a) => [a.href, a.rel, a.target]);
      return {bad: bad.length, handlers: handlers.map((el) => el.outerHTML.slice(0, 80)), links};
    }""")
    assert found["bad"] == 0 and found["handlers"] == [], found
    # Only http(s) links survive, and they open in a new tab with no opener.
    assert ["https://example.com/docs", "noopener noreferrer nofollow", "_blank"] in found["links"]
    assert all(href.startswith(("http://", "https://")) for href, _, _ in found["links"])
    # The image became a link and was never fetched.
    assert not [u for u in requests if "pixel.png" in u or "example.com" in u]

    # The renderer itself, fed more vectors, never makes an active element.
    assert page.evaluate("""async () => {
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
      return window.__pwned === undefined && els.every((el) =>
        ['P', 'STRONG', 'TABLE', 'THEAD', 'TBODY', 'TR', 'TH', 'TD', 'DIV', 'BR'].includes(el.tagName) &&
        el.attributes.length <= 1 && (!el.attributes.length || el.hasAttribute('class')));
    }""")
    assert page.title().startswith("<img src=x")  # the title is text too
    ctx.close()


# ---- 4. reload keeps conversations and settings --------------------------------------


def test_conversations_and_settings_survive_reload(browser: Browser, server: ServerProcess) -> None:
    page = open_page(browser, server)
    send(page, "Remember this chat.")
    wait_finished(page)
    page.click(".conv-item.active [data-action=rename]")
    page.fill(".conv-rename-input", "Kept chat")
    page.press(".conv-rename-input", "Enter")
    page.click("#system-box summary")
    page.fill("#system-prompt", "Answer briefly.")

    page.click("#new-chat")
    send(page, "A second chat.")
    wait_finished(page)
    models = json.loads(http_get(server.url + "/v1/models")[1])["data"]
    page.click("#open-settings")
    page.select_option("#set-model", models[0]["id"])
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
    expect(page.locator("#set-model")).to_have_value(models[0]["id"])
    expect(page.locator("#set-temperature")).to_have_value("1.3")
    expect(page.locator("#set-top-p")).to_have_value("0.9")
    expect(page.locator("#set-max-tokens")).to_have_value("33")
    expect(page.locator("#set-seed")).to_have_value("7")
    no_page_errors(page)
    page.context.close()


# ---- 5. phone and desktop, light and dark --------------------------------------------

WIDE = conversation(
    "cwide",
    "A conversation with a rather long title that must not push anything off screen",
    [
        ("user", "Show me wide things: " + "x" * 120),
        (
            "assistant",
            "# Wide things\n\nA long URL: https://example.com/" + "a/" * 60 + "\n\n"
            "```python\nprint('" + "wide " * 60 + "')\n```\n\n"
            "| name | value | notes |\n|---|---:|---|\n| alpha | 1 | " + "long cell " * 20 + "|\n\n"
            "- a list item with **bold** and `inline code`\n- " + "y" * 150 + "\n\n> a quote",
        ),
    ],
)


@pytest.mark.parametrize("size", [(390, 844), (1280, 800)], ids=["phone", "desktop"])
def test_layout_fits_phone_and_desktop_in_both_themes(
    browser: Browser, server: ServerProcess, size: tuple[int, int]
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for scheme in ("light", "dark"):
        page = open_page(browser, server, size, scheme, convs=[WIDE])
        expect(page.locator(".msg.assistant table")).to_be_visible()
        name = f"ui-{size[0]}x{size[1]}-{scheme}"
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
        sizes = page.evaluate("""() => ({
          doc: document.documentElement.scrollWidth, inner: innerWidth,
          msgs: document.getElementById('messages').scrollWidth,
          msgsClient: document.getElementById('messages').clientWidth})""")
        assert sizes["doc"] <= sizes["inner"], sizes
        assert sizes["msgs"] <= sizes["msgsClient"], sizes
        for sel in ["#send", "#prompt", "#open-settings", "#theme-toggle", "#conn-status"]:
            box = page.locator(sel).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= size[0], (sel, box)
        if size[0] < 700:
            page.click("#open-sidebar")
            expect(page.locator("#sidebar")).to_be_in_viewport()
            page.wait_for_timeout(250)  # the drawer's slide-in
            page.screenshot(path=str(ARTIFACTS / f"{name}-sidebar.png"))
            page.keyboard.press("Escape")
            expect(page.locator("#sidebar")).not_to_be_in_viewport()
        page.click("#open-settings")
        page.screenshot(path=str(ARTIFACTS / f"{name}-settings.png"))
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth")
        no_page_errors(page)
        page.context.close()


# ---- 6. the server goes away and comes back --------------------------------------------
# Last in the file: it restarts the module's server.


def test_reconnects_without_reload_when_the_server_returns(browser: Browser, server: ServerProcess) -> None:
    page = open_page(browser, server, settings={**FAST, "max_tokens": 1500})
    page.evaluate("window.__sameDocument = true")
    send(page, "Keep talking.")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-status", "streaming", timeout=15_000)

    server.stop()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "disconnected", timeout=10_000)
    expect(page.locator("#conn-status")).to_contain_text("Disconnected")
    expect(answer.locator(".msg-status")).to_contain_text("reconnecting")

    server.start()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    # The cut answer resumes (Redis broker) or is marked interrupted (memory broker).
    expect(answer).to_have_attribute("data-status", re.compile("streaming|done|interrupted"), timeout=10_000)
    if answer.get_attribute("data-status") == "interrupted":
        expect(answer.locator(".msg-error")).to_contain_text("could not resume")
    else:
        page.keyboard.press("Escape")
    open_settings(page, max_tokens="8")
    send(page, "Are you back?")
    expect(page.locator(".msg.assistant")).to_have_count(2)
    wait_finished(page)
    no_page_errors(page, allow="favicon|ERR_CONNECTION_REFUSED")  # the browser logs each refused try
    page.context.close()
