"""A fake engine: the broker's real traffic with no model (`wsllm engine --fake-step-ms N`).

It stands behind the worker's `Engine` interface, so the worker runs its real loop over
the real broker (pull, heartbeats, published events, acks, aborts, recovery) while the
"model" costs nothing but time: each step sleeps N ms (a sleep, not a spin, so that
dozens of them share two cores) and gives every running request one token. A load test
can then put 64 engines and thousands of streams on one machine and measure the broker
alone (bench/broker_scale.py, docs/scaling.md).

The loop keeps the real scheduler's shape: requests wait, are admitted into a running
batch of at most `max_num_seqs` in the order the broker handed them (it already ranked
them by priority and tenant), produce one token per step, and end at `max_tokens`
("length"); an abort is reported by the next step, as LLMEngine reports it. Prefill is
free: a request's first token comes with its first step.

The tokens are a fixed sentence of the model's own tokenizer, repeated: deterministic,
and text a gateway detokenizes like any answer. No torch is imported here.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wsllm.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from wsllm.types import FINISH_ABORT, FINISH_LENGTH, EngineBusy, GenerateRequest

log = logging.getLogger(__name__)

# What every answer says, over and over: ordinary words in any BPE vocabulary.
FAKE_TEXT = " The quick brown fox jumps over the lazy dog."


@dataclass(slots=True)
class _Req:
    """One request the fake engine holds."""

    request_id: str
    n: int  # choices; each gets the same tokens
    max_tokens: int
    num_prompt_tokens: int
    arrival: float  # wall-clock seconds, for queue_time
    produced: int = 0  # tokens given to each choice so far
    logprobs: bool = False  # the client asked for logprobs: send the (fake) chosen one


class FakeEngine:
    """`LLMEngine`'s contract with a sleep for a model; see the module docstring."""

    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        step_ms: float,
        *,
        max_num_seqs: int = 64,
        max_waiting: int = 1024,
        max_model_len: int | None = None,
    ) -> None:
        if not step_ms > 0:
            raise ValueError(f"step_ms must be > 0, got {step_ms}")
        self.model_dir = str(model_dir)
        self.model_name = model_name
        self.step_s = step_ms / 1000.0
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        cfg = _read_config(model_dir)
        self.max_model_len = max_model_len or int(cfg.get("max_position_embeddings", 2048))
        self.vocab_size = int(cfg.get("vocab_size", 0))
        self.token_ids = fake_token_ids(model_dir)
        self.waiting: deque[_Req] = deque()
        self.running: dict[str, _Req] = {}
        self._aborted: list[_Req] = []
        self.num_steps = 0
        self.num_aborted_total = 0
        self.adapters = None  # it holds no LoRA adapter

    # -- the Engine contract (wsllm.engine.worker_contract.Engine) ----------------------------

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request; ValueError on what LLMEngine would refuse too, EngineBusy
        when full. Priority and tenant were used by the broker's ranking already; a fake
        engine caches no prefix (`cache_salt` is ignored) and holds no LoRA adapter."""
        request_id, prompt_token_ids, params, lora = (
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.lora,
        )
        if lora:
            raise ValueError(f"the LoRA adapter {lora!r} is not loaded on this engine (a fake one)")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if self.vocab_size and any(t >= self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if params.pooling:
            raise ValueError("the fake engine computes no embeddings")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{total}, beyond the model's context of {self.max_model_len} tokens"
            )
        if self._known(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if len(self.waiting) + len(self.running) >= self.max_waiting + self.max_num_seqs:
            raise EngineBusy("the engine is full; retry later")
        now = request.arrival_time or time.time()
        n = params.beam_width if params.use_beam_search else params.n
        logprobs = params.logprobs is not None
        self.waiting.append(_Req(request_id, n, params.max_tokens, len(prompt_token_ids), now, 0, logprobs))

    def cached_prefix(self) -> tuple[int, list[bytes]]:
        """No prefix cache: no blocks to route by."""
        return 0, []

    def abort(self, request_id: str) -> bool:
        req = self.running.pop(request_id, None)
        if req is None:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
            if req is None:
                return False
            self.waiting.remove(req)
        self._aborted.append(req)
        self.num_aborted_total += 1
        return True

    def admission_rank(self) -> Callable[[int, str], tuple[int, float]]:
        """Higher priority first, then the broker's order (no tenant counters here)."""
        return lambda priority, tenant: (-priority, 0.0)

    def free_capacity(self) -> int:
        return max(0, self.max_num_seqs - len(self.running) - len(self.waiting))

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._aborted)

    def step(self) -> list[RequestOutput]:
        """Report aborts, admit, "compute" for step_ms, then one token per running request."""
        outputs = [self._output(r, [], FINISH_ABORT) for r in self._aborted]
        self._aborted.clear()
        admitted: set[str] = set()
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            self.running[r.request_id] = r
            admitted.add(r.request_id)
        time.sleep(self.step_s)  # the forward pass this engine does not do
        done = []
        for rid, r in self.running.items():
            token = self.token_ids[r.produced % len(self.token_ids)]
            r.produced += 1
            finish = FINISH_LENGTH if r.produced >= r.max_tokens else None
            out = self._output(r, [token], finish)
            if rid in admitted:
                out.queue_time = max(0.0, time.time() - r.arrival)
            outputs.append(out)
            if finish is not None:
                done.append(rid)
        for rid in done:
            del self.running[rid]
        self.num_steps += 1
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=0,
            kv_usage=len(self.running) / self.max_num_seqs,
            num_free_blocks=self.max_num_seqs - len(self.running),
            num_total_blocks=self.max_num_seqs,
            num_preemptions=0,
            num_swaps=0,
            num_cow=0,
            num_aborted_total=self.num_aborted_total,
            prefix_hit_rate=0.0,
            prefix_hit_tokens=0,
            prefix_queried_tokens=0,
            num_steps=self.num_steps,
        )

    # -- helpers -------------------------------------------------------------------------

    def _known(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self.waiting)

    def _output(self, r: _Req, tokens: list[int], finish: str | None) -> RequestOutput:
        lps = [[0.0, []] for _ in tokens] if r.logprobs else None
        choices = [
            CompletionOutput(i, list(tokens), r.produced, finish, lps if lps is None else list(lps))
            for i in range(r.n)
        ]
        return RequestOutput(r.request_id, r.num_prompt_tokens, choices, finished=finish is not None)


def fake_token_ids(model_dir: Path) -> list[int]:
    """FAKE_TEXT in the model's tokenizer (the tokenizers library: no torch)."""
    from tokenizers import Tokenizer

    ids = (
        Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        .encode(FAKE_TEXT, add_special_tokens=False)
        .ids
    )
    if not ids:
        raise ValueError(f"the tokenizer in {model_dir} encodes {FAKE_TEXT!r} to nothing")
    return list(ids)


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    cfg: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return cfg


__all__ = ["FAKE_TEXT", "FakeEngine", "fake_token_ids"]
