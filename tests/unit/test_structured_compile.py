"""Structured-output specs compile off the engine's step thread, with a deadline
(issue 23): a unique schema used to compile inside `add_request`, on the thread that
steps every stream of the engine, with no limit (and 64 cached specs: unique schemas
always miss). Now the request waits outside the scheduler while the matchers' thread
compiles it, and one that does not compile in time ends with invalid_request (a 400);
the gateway's check has a deadline of its own, and one past it no longer holds the
check pool's worker (its process is killed)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.outputs import RequestOutput
from wsllm.server import programs
from wsllm.server.programs import ProcessPool
from wsllm.types import GenerateRequest, SamplingParams

PROMPT = [1, 504, 3456, 77, 9012]


def heavy_spec() -> dict[str, Any]:
    """A regex of thousands of alternatives, unique (no cache hit): 0.1-0.3 s to compile."""
    tag = uuid.uuid4().hex[:8]
    return {"regex": "(" + "|".join(f"w{tag}{i}[a-z]{{2,5}}" for i in range(5000)) + ")"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_gb=0.05, max_num_seqs=16)
    engine = LLMEngine.from_config(cfg)
    engine.matchers.new({"regex": "a"})  # the tokenizer's index built before the timings
    return engine


def drain(engine: LLMEngine, max_step_s: list[float] | None = None) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        t = time.monotonic()
        outs = engine.step()
        if max_step_s is not None:
            max_step_s.append(time.monotonic() - t)
        final |= {o.request_id: o for o in outs if o.finished}
    return final


def test_a_unique_spec_compiles_off_the_step_thread_and_the_request_still_matches(
    engine: LLMEngine,
) -> None:
    engine.add_request(
        GenerateRequest("plain", PROMPT, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    )
    engine.step()  # its prompt
    spec = heavy_spec()
    t0 = time.monotonic()
    engine.add_request(
        GenerateRequest("heavy", PROMPT, SamplingParams(max_tokens=12, temperature=0, structured=spec))
    )
    took = time.monotonic() - t0
    assert took < 0.05, f"add_request compiled on the step thread for {took:.3f}s"
    streamed_meanwhile = 0  # the other stream's tokens while the spec compiled
    final: dict[str, RequestOutput] = {}  # a slow machine may finish "plain" before the spec compiles
    while len(engine.compiling):
        outs = engine.step()
        streamed_meanwhile += sum(len(o.outputs[0].new_token_ids) for o in outs if o.request_id == "plain")
        final |= {o.request_id: o for o in outs if o.finished}
    assert streamed_meanwhile > 0
    final |= drain(engine)
    assert final["plain"].outputs[0].num_tokens == 60 and final["heavy"].error_code is None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.matchers.model_dir)
    text = tok.decode(final["heavy"].outputs[0].token_ids, skip_special_tokens=True)
    assert re.fullmatch(spec["regex"], text), text


def test_a_spec_that_misses_its_deadline_is_an_invalid_request_and_others_go_on(engine: LLMEngine) -> None:
    deadline = engine.compiling.timeout_s
    engine.compiling.timeout_s = 0.001
    try:
        engine.add_request(
            GenerateRequest("plain", PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        )
        engine.add_request(
            GenerateRequest("slow", PROMPT, SamplingParams(max_tokens=8, structured=heavy_spec()))
        )
        final = drain(engine)
    finally:
        engine.compiling.timeout_s = deadline
    assert final["slow"].error_code == "invalid_request"
    assert "did not compile within" in (final["slow"].error or "")
    assert final["plain"].error_code is None and final["plain"].outputs[0].num_tokens == 20
    assert not engine.block_manager.block_tables and len(engine.compiling) == 0


def test_aborting_a_request_whose_spec_compiles_forgets_it(engine: LLMEngine) -> None:
    engine.add_request(GenerateRequest("gone", PROMPT, SamplingParams(max_tokens=8, structured=heavy_spec())))
    assert engine.abort("gone")
    final = drain(engine)
    assert final["gone"].outputs[0].finish_reason == "abort"
    assert len(engine.compiling) == 0 and not engine.has_unfinished()


def test_a_check_past_its_deadline_frees_its_worker() -> None:
    """A compile is Rust code that nothing interrupts: a job past its deadline has its
    process killed, and the next job runs in a fresh one at once instead of waiting for
    it. (A job that would hold the pool's one worker for a minute stands for the compile.)"""
    pool = ProcessPool(1, 0, time.sleep, "test-slow-check")

    async def go() -> float:
        await pool.run(0, 30.0, "warm")  # the process started
        first = pool.pids[0]
        with pytest.raises(TimeoutError):
            await pool.run(60, 0.3, "mallory")
        for _ in range(100):  # its slot notices within a poll (50 ms), and starts the next
            if pool.pids[0] not in (None, first):
                break
            await asyncio.sleep(0.02)
        assert first is not None and pool.killed == 1 and pool.pids[0] not in (None, first)
        assert not Path(f"/proc/{first}").exists(), "the process past its deadline still runs"
        t = time.monotonic()
        await pool.run(0, 30.0, "alice")
        return time.monotonic() - t

    assert asyncio.run(go()) < 5.0


def test_the_gateways_check_runs_in_its_pool_with_a_deadline() -> None:
    async def go() -> None:
        assert await programs.check({"regex": "[a-z]+"}, 30.0, "t") < 30.0
        with pytest.raises(ValueError, match="regex"):  # the check's own error comes back
            await programs.check({"regex": "(unclosed"}, 30.0, "t")
        with pytest.raises(ValueError, match=r"structured\.regex: did not compile within 0\.001s"):
            await programs.check(heavy_spec(), 0.001, "t")

    asyncio.run(go())


@pytest.mark.parametrize("at_start", [False, True])
def test_the_tokenizer_index_is_built_by_the_first_structured_request_unless_asked_at_start(
    tiny_model_dir: Path, at_start: bool
) -> None:
    """The index holds 100+ MB for the life of the process: a server nobody asks for
    structured output never builds it (EngineConfig.structured_index_at_start builds it
    when the model loads, as every server once did)."""
    cfg = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", kv_cache_gb=0.01, structured_index_at_start=at_start
    )
    engine = LLMEngine.from_config(cfg)
    engine.matchers.warm()  # as the servers do once the model is loaded
    engine.matchers._pool.submit(lambda: None).result()  # whatever warm queued has run
    assert (engine.matchers._tokenizer is not None) == at_start
    engine.add_request(
        GenerateRequest(
            "s", PROMPT, SamplingParams(max_tokens=6, temperature=0, structured={"choice": ["yes", "no"]})
        )
    )
    out = drain(engine)["s"]
    assert out.error is None and out.outputs[0].token_ids, out
    assert engine.matchers._tokenizer is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice per thread is Linux's")
def test_specs_compile_below_the_engine_threads_priority(engine: LLMEngine) -> None:
    """On 2 cores a unique schema's compile beside the two torch threads of a step
    stretched every stream's gap (bench/amplification.py): it runs niced, the wait its
    own request's."""
    from wsllm.structured import COMPILE_NICE

    tid = engine.matchers._pool.submit(threading.get_native_id).result()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, mine + COMPILE_NICE)
