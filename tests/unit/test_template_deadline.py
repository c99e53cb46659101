"""A chat template is a program the gateway runs on every chat request (issue 23): it
renders off the event loop on a bounded, niced pool of threads that takes tenants in
turn (wsllm/server/programs.py), within a time limit; one that loops is interrupted and
its thread goes on to the next template, rather than holding a core (or a thread) for
ever; jinja2 is a version without the known sandbox escapes."""

from __future__ import annotations

import asyncio
import threading
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from wsllm.server.programs import ThreadPool
from wsllm.server.text import TextCodec

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def hostile(smollm_dir: Path) -> TextCodec:
    codec = TextCodec(str(smollm_dir))
    codec.hf.chat_template = LOOPS
    return codec


def test_a_looping_template_times_out_the_loop_stays_responsive_and_the_thread_goes_on(
    hostile: TextCodec, smollm_dir: Path
) -> None:
    pool = ThreadPool(1, 0, "test-template")
    good = TextCodec(str(smollm_dir))

    async def go() -> tuple[float, float, float]:
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
        with pytest.raises(TimeoutError):
            await pool.run(lambda: hostile.encode_chat(MSGS), 0.5, "mallory")
        took = time.monotonic() - t0
        t1 = time.monotonic()  # the pool's one thread renders the next template at once
        assert await pool.run(lambda: good.encode_chat(MSGS), 5.0, "alice") == good.encode_chat(MSGS)
        tick.cancel()
        return took, max(gaps), time.monotonic() - t1

    took, worst_gap, next_one = asyncio.run(go())
    assert took < 1.0
    assert worst_gap < 0.25  # the loop kept running while the template did
    assert next_one < 1.0, "the looping template still held the pool's thread"
    assert len([t for t in threading.enumerate() if t.name.startswith("test-template")]) == 1


def test_a_good_template_renders_and_its_errors_come_through(smollm_dir: Path) -> None:
    pool = ThreadPool(1, 0, "test-template-ok")
    codec = TextCodec(str(smollm_dir))
    ids = asyncio.run(pool.run(lambda: codec.encode_chat(MSGS), 5.0, "alice"))
    assert ids == codec.encode_chat(MSGS)
    with pytest.raises(ZeroDivisionError):
        asyncio.run(pool.run(lambda: 1 // 0, 5.0, "alice"))


def test_the_pool_takes_tenants_in_turn() -> None:
    """A tenant that queues many templates delays another's by one template, not by all
    of its own."""
    pool = ThreadPool(1, 0, "test-template-fair")
    ended: list[str] = []

    def work(name: str) -> None:
        until = time.monotonic() + 0.05
        while time.monotonic() < until:
            pass
        ended.append(name)

    async def go() -> None:
        flood = [asyncio.create_task(pool.run(lambda i=i: work(f"a{i}"), 10.0, "a")) for i in range(6)]
        await asyncio.sleep(0.01)  # a0 runs; a1..a5 wait
        await pool.run(lambda: work("b"), 10.0, "b")
        await asyncio.gather(*flood)

    asyncio.run(go())
    assert ended.index("b") <= 2, ended


def test_jinja2_is_pinned_past_its_sandbox_escapes() -> None:
    """CVE-2024-56201 / CVE-2024-56326 (3.1.5) and CVE-2025-27516 (3.1.6): a template
    could break out of the sandbox the chat templates run in."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    req = next(Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("jinja2"))
    assert not req.specifier.contains("3.1.5") and req.specifier.contains("3.1.6")
