"""Browser tests of the chat UI (frontend/): Debian's chromium driven by Playwright,
against a live `wsllm serve` with a tiny random-weight model.

The server is a real `wsllm serve` child process on a free port, shared by the
session, so that the reconnect test can stop it and start it again on the same port.
Set WSLLM_UI_SERVER_CMD (a command with {port} and {model} placeholders) to run the
UI tests against another server, e.g. one on the Redis broker.

    def test_x(ui):              # ui.server, ui.page(...), ui.send(page, text), ...
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"  # git-ignored
AXE = Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js"

# Short, deterministic answers: greedy decoding of the tiny random model.
FAST = {"max_tokens": 24, "temperature": 0, "top_p": 1}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    missing = not Path(CHROMIUM).exists()
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.slow)
            if missing:
                item.add_marker(pytest.mark.skip(reason=f"needs Debian's chromium at {CHROMIUM}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (a local test server)
        return r.status, r.read()


class ServerProcess:
    """`wsllm serve` as a child process that can be stopped and started on one port."""

    def __init__(self, model: Path, port: int, log: Path) -> None:
        self.model, self.port, self.log = model, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.headers: dict[str, str] = {}  # sent with /v1/models and /metrics

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
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if self.ready():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def ready(self) -> bool:
        return http_get(f"{self.url}/v1/models", headers=self.headers)[0] == 200

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
        body = http_get(f"{self.url}/metrics", headers=self.headers)[1].decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))


class TwoModelServer(ServerProcess):
    """`wsllm serve --model A --model B` (one engine per model in one process) with API
    keys: tenant `alice` may have one request in flight, `bob` any number (and bob's key
    reads every tenant's figures on /metrics: the `metrics` role). Each engine
    runs one sequence at a time and a request waits at most 0.3 s for one, so a second
    request behind a long answer gets `queue_timeout` (however fast the engine: 2,000 tokens
    of the tiny model take about a second); the server's limits differ from
    the defaults (max_tokens 2000, 3 stop strings), so the UI must take them from the hello."""

    KEYS = {"alice": "sk-alice", "bob": "sk-bob"}

    def __init__(self, models: list[Path], port: int, log: Path, keys_file: Path) -> None:
        super().__init__(models[0], port, log)
        self.models, self.keys_file = models, keys_file
        keys_file.write_text(
            '[tenants.alice]\nkeys = ["sk-alice"]\nmax_concurrent = 1\n\n'
            '[tenants.bob]\nkeys = ["sk-bob"]\nroles = ["metrics"]\n'
        )
        self.headers = {"Authorization": f"Bearer {self.KEYS['bob']}"}

    def command(self) -> list[str]:
        exe = shutil.which("wsllm", path=str(Path(sys.executable).parent)) or "wsllm"
        models = [arg for m in self.models for arg in ("--model", str(m))]
        return [exe, "serve", *models, "--port", str(self.port), "--kv-cache-gb", "0.05", "--threads", "1",
                "--api-keys-file", str(self.keys_file), "--max-num-seqs", "1", "--queue-timeout-s", "0.3",
                "--max-tokens-limit", "2000", "--max-stop", "3"]  # fmt: skip

    def ready(self) -> bool:
        """Both engines are up: /v1/models lists every model."""
        body = json.loads(http_get(f"{self.url}/v1/models", headers=self.headers)[1])
        return {m["id"] for m in body["data"]} == {m.name for m in self.models}


def seed_script(settings: dict[str, Any], convs: list[dict[str, Any]] | None = None) -> str:
    """An init script that fills localStorage once per tab (not again on reload)."""
    items: dict[str, Any] = {"wsllm.v1.settings": settings}
    for c in convs or []:
        items[f"wsllm.v1.conv.{c['id']}"] = c
    if convs:
        items["wsllm.v1.active"] = convs[0]["id"]
    return (
        "if (!sessionStorage.getItem('seeded')) { sessionStorage.setItem('seeded', '1');"
        f" for (const [k, v] of Object.entries({json.dumps(items)})) localStorage.setItem(k, JSON.stringify(v)); }}"
    )


def conversation(cid: str, title: str, messages: list[tuple[str, str]], system: str = "") -> dict[str, Any]:
    """A stored conversation in the UI's localStorage format (docs/ui.md)."""
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


def wait_until(fn: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Ui:
    """Opens pages on the live server and drives the common gestures."""

    FAST = FAST
    ARTIFACTS = ARTIFACTS
    conversation = staticmethod(conversation)
    wait_until = staticmethod(wait_until)
    http_get = staticmethod(http_get)

    def __init__(self, browser: Any, server: ServerProcess) -> None:
        self.browser, self.server = browser, server

    def page(
        self,
        size: tuple[int, int] = (1280, 800),
        scheme: str = "light",
        settings: dict[str, Any] | None = None,
        convs: list[dict[str, Any]] | None = None,
        connected: bool = True,
        requests: list[str] | None = None,
        **context: Any,
    ) -> Any:
        """A new tab with seeded localStorage; `requests` collects every URL it asks for;
        `context`: more options of the browser context (e.g. bypass_csp=True)."""
        from playwright.sync_api import expect

        viewport = {"width": size[0], "height": size[1]}
        ctx = self.browser.new_context(viewport=viewport, color_scheme=scheme, **context)
        if requests is not None:
            ctx.on("request", lambda r: requests.append(r.url))
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.errors = errors
        page.add_init_script(seed_script(FAST if settings is None else settings, convs))
        page.goto(self.server.url + "/")
        if connected:
            expect(page.locator("#conn-status")).to_have_attribute("data-state", "connected", timeout=15_000)
        return page

    @staticmethod
    def send(page: Any, text: str) -> None:
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")

    @staticmethod
    def last_answer(page: Any) -> Any:
        return page.locator(".msg.assistant").last

    def wait_finished(self, page: Any, timeout: float = 30_000) -> None:
        from playwright.sync_api import expect

        expect(self.last_answer(page)).to_have_attribute(
            "data-status", re.compile("done|stopped"), timeout=timeout
        )

    @staticmethod
    def set_settings(page: Any, **values: str) -> None:
        from playwright.sync_api import expect

        page.click("#open-settings")
        for key, value in values.items():
            page.fill(f"#set-{key.replace('_', '-')}", value)
        page.click("#settings-dialog button.primary")
        expect(page.locator("#settings-dialog")).to_be_hidden()

    @staticmethod
    def assert_no_errors(page: Any, allow: str = "favicon") -> None:
        errors = [e for e in page.errors if not re.search(allow, e)]
        assert not errors, errors

    @staticmethod
    def record_frames(page: Any) -> list[dict[str, Any]]:
        """Reload `page` with its socket's outgoing frames recorded (JSON) into the list returned;
        the incoming ones go to `page.received`."""
        from playwright.sync_api import expect

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

    @staticmethod
    def stored_conv(page: Any) -> dict[str, Any]:
        """The conversation on screen as localStorage holds it."""
        return dict(
            page.evaluate(
                "() => JSON.parse(localStorage.getItem('wsllm.v1.conv.' + JSON.parse(localStorage.getItem('wsllm.v1.active'))))"
            )
        )

    @staticmethod
    def axe_serious(page: Any) -> list[str]:
        """axe-core's violations of impact serious or critical, as `rule: target` lines. The page
        must have been opened with bypass_csp=True: the CSP refuses the injected script."""
        if not page.evaluate("typeof axe !== 'undefined'"):
            page.add_script_tag(path=str(AXE))
        found = page.evaluate("""async () => {
          const r = await axe.run(document, {resultTypes: ['violations']});
          return r.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical')
            .flatMap((v) => v.nodes.map((n) => `${v.id}: ${n.target.join(' ')} (${n.failureSummary})`));
        }""")
        return list(found)


@pytest.fixture(scope="session")
def ui_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_model_dir, free_port(), tmp_path_factory.mktemp("ui-server") / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        b.close()


def _ui_on(browser: Any, server: ServerProcess) -> Iterator[Ui]:
    yield Ui(browser, server)
    for ctx in list(browser.contexts):  # every page a test opened
        ctx.close()


@pytest.fixture
def ui(browser: Any, ui_server: ServerProcess) -> Iterator[Ui]:
    yield from _ui_on(browser, ui_server)


@pytest.fixture(scope="session")
def two_model_server(
    tiny_model_dir: Path, tiny_words_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoModelServer]:
    """Started only by the tests that ask for it (the model picker, limits, errors)."""
    tmp = tmp_path_factory.mktemp("ui-two-models")
    models = [tmp / "tiny-llama", tmp / "tiny-words"]  # the served names are the directories'
    models[0].symlink_to(tiny_model_dir)
    models[1].symlink_to(tiny_words_model_dir)
    srv = TwoModelServer(models, free_port(), tmp / "server.log", tmp / "keys.toml")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def ui2(browser: Any, two_model_server: TwoModelServer) -> Iterator[Ui]:
    """`ui` on the two-model server; pages need settings with an `api_key` of KEYS."""
    yield from _ui_on(browser, two_model_server)


@pytest.fixture(scope="session")
def smollm_server(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`wsllm serve` with the bundled SmolLM2 (real weights: it answers in words and calls
    tools when made to), started only by the tests that ask for it."""
    srv = ServerProcess(smollm_dir, free_port(), tmp_path_factory.mktemp("ui-smollm") / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def ui_smol(browser: Any, smollm_server: ServerProcess) -> Iterator[Ui]:
    """`ui` on the SmolLM2 server."""
    yield from _ui_on(browser, smollm_server)


class NarrowBoundServer(ServerProcess):
    """`wsllm serve` with one sampling bound declared narrower, in its one place
    (wsllm.bounds.SAMPLING_BOUNDS: presence_penalty in [-0.5, 0.5]), before anything reads it."""

    PATCH = (
        "import sys; import wsllm.bounds as t; "
        "t.SAMPLING_BOUNDS['presence_penalty'] = t.Bound(-0.5, 0.5); "
        "from wsllm.cli import main; sys.exit(main())"
    )

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.PATCH, "serve", "--model", str(self.model), "--port", str(self.port),
                "--kv-cache-gb", "0.05", "--threads", "1"]  # fmt: skip


@pytest.fixture
def ui_narrow(browser: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ui]:
    """`ui` on a NarrowBoundServer (started for the test that asks for it)."""
    srv = NarrowBoundServer(tiny_model_dir, free_port(), tmp_path_factory.mktemp("ui-narrow") / "server.log")
    srv.start()
    try:
        yield from _ui_on(browser, srv)
    finally:
        srv.stop()


@pytest.fixture
def ui_vlm(browser: Any, tiny_smolvlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ui]:
    """`ui` on a `wsllm serve` of the tiny SmolVLM (tests/tiny_vlm.py; started for the test that asks for it)."""
    srv = ServerProcess(tiny_smolvlm_dir, free_port(), tmp_path_factory.mktemp("ui-vlm") / "server.log")
    srv.start()
    try:
        yield from _ui_on(browser, srv)
    finally:
        srv.stop()
