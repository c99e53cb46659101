"""A chat template is a program the gateway runs on every chat request (issue 23): it
renders off the event loop, within a time limit, and one that loops is stopped (its
thread ends) rather than holding a core for ever; jinja2 is a version without the
known sandbox escapes."""

from __future__ import annotations

import asyncio
import threading
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from wsllm.server.text import TemplateTimeout, TextCodec, run_with_deadline

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def hostile(smollm_dir: Path) -> TextCodec:
    codec = TextCodec(str(smollm_dir))
    codec.hf.chat_template = LOOPS
    return codec


def template_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wsllm-chat-template"]


def test_a_looping_template_times_out_the_loop_stays_responsive_and_the_thread_ends(
    hostile: TextCodec,
) -> None:
    async def go() -> tuple[float, float]:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        t0 = time.monotonic()
        with pytest.raises(TemplateTimeout, match="longer than 0.5s"):
            await run_with_deadline(lambda: hostile.encode_chat(MSGS), 0.5, "chat-template")
        took = time.monotonic() - t0
        tick.cancel()
        return took, max(gaps)

    took, worst_gap = asyncio.run(go())
    assert took < 1.0
    assert worst_gap < 0.25  # the loop kept running while the template did
    deadline = time.monotonic() + 2
    while template_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not template_threads(), "the looping template still runs"


def test_a_good_template_renders_and_its_errors_come_through(smollm_dir: Path) -> None:
    codec = TextCodec(str(smollm_dir))
    ids = asyncio.run(run_with_deadline(lambda: codec.encode_chat(MSGS), 5.0, "chat-template"))
    assert ids == codec.encode_chat(MSGS)
    with pytest.raises(ZeroDivisionError):
        asyncio.run(run_with_deadline(lambda: 1 // 0, 5.0, "chat-template"))


def test_jinja2_is_pinned_past_its_sandbox_escapes() -> None:
    """CVE-2024-56201 / CVE-2024-56326 (3.1.5) and CVE-2025-27516 (3.1.6): a template
    could break out of the sandbox the chat templates run in."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    req = next(Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("jinja2"))
    assert not req.specifier.contains("3.1.5") and req.specifier.contains("3.1.6")
