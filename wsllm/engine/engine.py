"""LLMEngine: one step = schedule -> run the model -> postprocess (sample, append, report).

Contract: `add_request`, `abort`, `step() -> list[RequestOutput]`,
`has_unfinished()`, `free_capacity()`. Queues, blocks and tensors stay private.
The engine is not thread-safe: one thread (the worker) drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from wsllm.config import EngineConfig
from wsllm.engine.adapters import Adapters, adapter_root
from wsllm.engine.beam import BeamSearcher
from wsllm.engine.block_manager import BlockManager
from wsllm.engine.cache_engine import CacheEngine, kv_cache_dtype, num_kv_blocks
from wsllm.engine.checks import check_request
from wsllm.engine.model_runner import ModelRunner, Pooled, PromptLogprobs
from wsllm.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from wsllm.engine.request import Request
from wsllm.engine.sampler import Sampler
from wsllm.engine.scheduler import Scheduler
from wsllm.engine.sequence import Sequence
from wsllm.engine.speculative import build as build_speculator
from wsllm.engine.speculative.draft import load_draft
from wsllm.engine.static_step import make_static_step
from wsllm.models.build import build_model
from wsllm.models.causal_lm import CausalLM
from wsllm.structured import Matchers, PendingCompiles
from wsllm.types import (
    ERR_INTERNAL,
    ERR_INVALID_REQUEST,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    SamplingParams,
)

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        model_dir: Path,
        model_name: str,
        eos_token_ids: list[int],
    ) -> None:
        self.config = config
        self.model_dir = str(model_dir)
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.pooling = mc.pooling if config.pooling == "auto" else config.pooling
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        device = next(model.parameters()).device
        dtype, why = kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype, device)
        log.info("KV cache dtype %s (%s)", str(dtype).removeprefix("torch."), why)
        bs = config.block_size
        draft = load_draft(config, mc.vocab_size) if config.speculative == "draft" else None  # weights first
        static = make_static_step(config, model, self.max_model_len, device)  # its memory before the KV's
        num_blocks, num_cpu = num_kv_blocks(config, mc, dtype, device, static.reserved_bytes if static else 0)
        self.cache = CacheEngine(mc, num_blocks, bs, dtype, device, num_cpu)
        self.block_manager = BlockManager(num_blocks, bs, config.watermark, config.enable_prefix_caching)
        self.scheduler = Scheduler.from_config(self.block_manager, config, num_cpu)
        self.sampler = Sampler(mc.vocab_size, eos_token_ids, config.seed)
        self.spec = build_speculator(
            config, self.sampler, eos_token_ids, self.max_model_len, draft, num_blocks * bs
        )
        self.matchers = Matchers(model_dir, mc.vocab_size, eos_token_ids, config.structured_index_at_start)
        self.compiling = PendingCompiles(config.structured_compile_timeout_s)  # their sequences wait here
        self.beams = BeamSearcher(self.scheduler, mc.vocab_size)
        self.runner = ModelRunner(model, self.cache.kv_caches, bs, device, static)
        self.adapters = Adapters(config, mc, model_name, device, self.runner.dtype)  # LoRA (docs/lora.md)
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.num_aborted_total = 0
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> LLMEngine:
        config = config or EngineConfig()
        built = build_model(config)
        return cls(config, built.model, built.model_dir, built.name, built.eos_token_ids)

    # -- contract -----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        cache_root: bytes | None = None,
        lora: str = "",
    ) -> None:
        """Queue a request. Raises ValueError, leaving the engine as it was, on bad input.
        A higher `priority` is admitted first; within a priority, `tenant`s share the
        batch by tokens served (see Scheduler). `cache_root`: the prefix cache namespace
        its blocks are shared in (prefix_hash.cache_root; None: the common one), which its
        LoRA adapter `lora` (a name `adapters` holds; "": the base) extends."""
        if params.pooling == "auto":  # an embedding request: this model's pooling
            params = dataclasses.replace(params, pooling=self.pooling)
        check_request(
            request_id, prompt_token_ids, params, in_use=request_id in self._requests, held=len(self._requests),
            vocab_size=self.vocab_size, max_model_len=self.max_model_len, bm=self.block_manager, config=self.config,
        )  # fmt: skip
        adapter = self.adapters.get(lora) if lora else None
        now = arrival_time if arrival_time is not None else time.time()
        req = Request.start(request_id, prompt_token_ids, params, now, priority, tenant, self.eos_token_ids)
        for seq in req.seqs:
            seq.cache_root, seq.lora = adapter_root(cache_root, adapter), adapter
        self._requests[request_id] = req
        if params.structured is not None:  # compiled off this thread; step() schedules it when done
            self.compiling.add(request_id, self.matchers.start(params.structured))
        else:
            self.scheduler.add(req.seqs[0])

    def abort(self, request_id: str) -> bool:
        """Stop a request now. Its blocks are freed before this returns; the next
        step() reports it with finish_reason 'abort'."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.compiling.drop(request_id)
        self._end(req, FINISH_ABORT)
        self._aborted.append(req)
        self.num_aborted_total += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def is_known(self, request_id: str) -> bool:
        return request_id in self._requests

    def admission_rank(self) -> Callable[[int, str], tuple[int, float]]:
        """Rank (lower first) of a request by (priority, tenant), as the scheduler would
        admit it now: brokers that can choose hand this engine the best ones first."""
        return self.scheduler.admission_rank()

    def free_capacity(self) -> int:
        """How many more requests to admit now: room in the running batch plus what
        the free KV blocks could start, minus what already waits."""
        s = self.scheduler
        waiting = len(s.waiting) + len(s.swapped) + len(self.compiling)
        room = self.config.max_num_seqs - len(s.running) - waiting
        bm = self.block_manager
        avg = max(1, bm.blocks_for(256))
        kv_room = (bm.num_free_blocks - bm.watermark_blocks) // avg - waiting
        return max(0, min(room, max(kv_room, 1 if not s.running and not waiting else 0)))

    def step(self) -> list[RequestOutput]:
        outputs = self._flush_aborted() + self._admit_compiled()
        started = time.perf_counter()
        self.spec.propose(self.scheduler.running, bool(self.scheduler.waiting or self.scheduler.swapped))
        sched = self.scheduler.schedule()
        self.cache.apply(sched.swap_out, sched.swap_in, sched.copies)
        if sched.scheduled:
            want = self._want_prompt_logprobs(sched.scheduled)
            pool = {q.seq_id: q.params.pooling for q, _ in sched.scheduled if q.params.pooling}
            tables = self.block_manager.block_tables
            seqs, logits, prompt, pooled = self.runner.run(sched.scheduled, tables, want, pool or None)
            outputs += self._postprocess(sched.scheduled, seqs, logits, prompt, pooled)
            seconds = time.perf_counter() - started
            self.scheduler.observe_step(sched, seconds)
            self.spec.observe_step(sched.num_tokens, not sched.prefill_cost, seconds)
        self.num_steps += 1
        return outputs

    def cached_prefix(self, limit: int = 16384) -> tuple[int, list[bytes]]:
        """(block size, chain keys of up to `limit` cached prefix blocks, newest last):
        what a broker publishes for prefix-aware routing. Empty without prefix caching."""
        bm = self.block_manager
        return bm.block_size, bm.cached_keys(limit) if bm.enable_prefix_caching else []

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len({q.request_id for q in s.running}),
            num_waiting=len({q.request_id for q in s.waiting}),
            num_swapped=len({q.request_id for q in s.swapped}),
            kv_usage=bm.usage(),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_preemptions=s.num_preemptions,
            num_swaps=s.num_swaps,
            num_cow=bm.num_cow,
            num_aborted_total=self.num_aborted_total,
            prefix_hit_rate=bm.hit_rate,
            prefix_hit_tokens=bm.hit_tokens,
            prefix_queried_tokens=bm.queried_tokens,
            num_steps=self.num_steps,
            spec_draft_tokens=self.spec.stats.drafted,
            spec_accepted_tokens=self.spec.stats.accepted,
            spec_verifications=self.spec.stats.verifications,
        )

    # -- one step's postprocess ----------------------------------------------
    def _postprocess(
        self,
        scheduled: list[tuple[Sequence, int]],
        seqs: list[Sequence],
        logits: torch.Tensor | None,
        prompt: list[PromptLogprobs],
        pooled: list[Pooled],
    ) -> list[RequestOutput]:
        """After the forward pass: keep the prompt logprobs computed, end the embedding
        requests whose prompt is computed, give the rows that caught up their next token,
        advance the scheduler, and report every request that got tokens or ended."""
        for c in prompt:
            if (req := self._requests.get(c.seq.request_id)) is not None:
                req.keep_prompt_logprobs(c.first, c.entries)
        embedded = []
        for p in pooled:
            req = self._requests.get(p.seq.request_id)
            if req is not None and req.keep_pooled(p.start, p.num_tokens, p.vector, p.caught_up):
                embedded.append(self._requests.pop(req.request_id))
        outputs: list[RequestOutput] = []
        if logits is not None:
            seqs, rest, bad = self.spec.verify(seqs, logits)  # the rows that verify drafts
            if rest is not None:
                seqs, rest, searched = self.beams.split(seqs, rest, self._requests)
                outputs += [self._beam_output(r) for r in searched if r.beam and r.beam.done]  # type: ignore[arg-type]
            if rest is not None and seqs:
                seqs, rest = self._fork_children(seqs, rest)
                bad += self._sample(seqs, rest)
            outputs += self._fail_each(bad)
        scheduled = self.spec.settle(scheduled, self.block_manager)  # rejected drafts: not computed
        self.scheduler.finish_step(scheduled)  # offers the embeddings' full blocks to the prefix cache
        for req in embedded:
            self._end(req, FINISH_STOP)  # never sampled; its blocks are freed now
        return outputs + self._collect(scheduled) + [r.output() for r in embedded]

    def _want_prompt_logprobs(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int] | None:
        """seq_id -> top N, for the sequences whose prompt logprobs are not all computed."""
        want: dict[int, int] = {}
        for seq, _ in scheduled:
            req = self._requests.get(seq.request_id)
            if req is not None and seq.params.prompt_logprobs is not None and req.wants_prompt_logprobs():
                want[seq.seq_id] = seq.params.prompt_logprobs
        return want or None

    def _fork_children(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """n > 1: when the first choice finishes its prompt, the other choices fork
        from it, sharing its blocks, and sample their first token from its logits."""
        rows: list[int] = []
        out: list[Sequence] = []
        for i, seq in enumerate(seqs):
            req = self._requests.get(seq.request_id)
            children = [] if req is None else req.fork_pending(seq, self.scheduler)
            rows += [i] * (1 + len(children))
            out += [seq, *children]
        if len(out) == len(seqs):
            return seqs, logits
        return out, logits[torch.tensor(rows)]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, str, str]]:
        """Sample each row's next token and append it to its sequence, which decides
        whether it stops. Returns the sequences whose request must fail, with a code and why."""
        result, failed = self.sampler.sample_isolated(logits, seqs)
        bad = [(seqs[i], ERR_INTERNAL, reason) for i, reason in failed.items()]
        for i, (seq, tok, lp) in enumerate(zip(seqs, result.token_ids, result.logprobs, strict=True)):
            if i not in failed and (
                error := seq.append_token(tok, lp, self.eos_token_ids, self.max_model_len)
            ):
                bad.append((seq, ERR_INVALID_REQUEST, error))
        return bad

    def _beam_output(self, req: Request) -> RequestOutput:
        del self._requests[req.request_id]
        return req.beam_output()

    def _end(self, req: Request, reason: str) -> None:
        """Finish every choice of `req` now, freeing its blocks."""
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
            seq.end(reason)

    def _fail(self, req: Request, code: str, message: str) -> RequestOutput:
        """End a request the engine could not serve, freeing its blocks now."""
        self._requests.pop(req.request_id, None)
        self._end(req, FINISH_ERROR)
        out = req.output()
        out.error_code, out.error = code, message
        return out

    def _fail_each(self, bad: list[tuple[Sequence, str, str]]) -> list[RequestOutput]:
        """Fail the requests of these sequences, each once, with its first reason."""
        first = {seq.request_id: (code, why) for seq, code, why in reversed(bad)}
        return [self._fail(self._requests[r], c, w) for r, (c, w) in first.items() if r in self._requests]

    def _collect(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        for seq, _ in scheduled:
            if seq.new_token_ids and seq.request_id in self._requests:
                touched[seq.request_id] = self._requests[seq.request_id]
        outs = []
        for rid, req in touched.items():
            outs.append(req.output())
            if outs[-1].finished:
                del self._requests[rid]
        return outs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose structured-output spec compiled join the scheduler, with choice
        0's matcher (choices 1..n-1 copy it when they fork); those whose spec failed or
        missed its deadline end with an invalid_request error."""
        s = self.scheduler
        idle = not (s.running or s.waiting or s.swapped)
        ready, failed = self.compiling.poll(wait_s=0.01 if idle else 0.0)
        for rid, matcher in ready:
            if (req := self._requests.get(rid)) is not None:
                req.seqs[0].matcher = matcher
                s.add(req.seqs[0])
        return [
            self._fail(self._requests[rid], ERR_INVALID_REQUEST, why)
            for rid, why in failed
            if rid in self._requests
        ]

    def _flush_aborted(self) -> list[RequestOutput]:
        outs = [r.output() for r in self._aborted]
        self._aborted.clear()
        return outs


__all__ = ["LLMEngine", "RequestOutput", "CompletionOutput", "EngineStats"]
