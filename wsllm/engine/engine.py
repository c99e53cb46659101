"""LLMEngine: one step = schedule -> run -> update, three calls (vLLM's EngineCore.step).

`scheduler.schedule()` (the speculator's drafts already in the running sequences),
`runner.run(...) -> ModelOutput` (the forward pass and the token stage on the logits' device:
only sampled ids and asked-for logprobs come back, once), `scheduler.update_from_output(...)`
(what each sequence computed, appended, forked, finished). Then the step's time goes to the one
step-cost model, and each request reports.

Contract: `add_request(GenerateRequest)`, `abort`, `step() -> list[RequestOutput]`,
`has_unfinished()`, `free_capacity()`. Queues, blocks and tensors stay private.
The engine is not thread-safe: one thread (the worker) drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from wsllm.config import EngineConfig
from wsllm.engine.adapters import Adapters, adapter_root
from wsllm.engine.cache_engine import CacheEngine, kv_cache_dtype, num_kv_blocks
from wsllm.engine.checks import check_admissible
from wsllm.engine.encoder_cache import EncoderCache
from wsllm.engine.encoder_step import EncoderStep
from wsllm.engine.kv_groups import kv_bytes_used, kv_groups, make_kv_manager, runner_tables, split_blocks
from wsllm.engine.model_output import ModelOutput
from wsllm.engine.model_runner import ModelRunner
from wsllm.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from wsllm.engine.request import Request
from wsllm.engine.sampler import Sampler
from wsllm.engine.scheduler import Scheduler, StepUpdate
from wsllm.engine.sequence import Sequence
from wsllm.engine.speculative import build as build_speculator
from wsllm.engine.speculative.draft import load_draft
from wsllm.engine.static_step import make_static_step
from wsllm.engine.step_cost import StepCost, attention_span
from wsllm.models.build import build_model
from wsllm.models.causal_lm import CausalLM
from wsllm.prefix_hash import request_images, request_root
from wsllm.structured import Matchers, PendingCompiles
from wsllm.types import (
    ERR_INVALID_REQUEST,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    GenerateRequest,
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
        groups = kv_groups(mc)  # layers by window: a block table per group (kv_groups.py)
        static = make_static_step(config, model, self.max_model_len, device, len(groups))  # before the KV
        num_blocks, num_cpu = num_kv_blocks(config, mc, dtype, device, static.reserved_bytes if static else 0)
        split = (bs, config.max_num_seqs, config.max_num_batched_tokens)
        sizes = split_blocks(groups, num_blocks, *split)
        cpu_sizes = split_blocks(groups, num_cpu, *split) if num_cpu else [0] * len(groups)
        self.cache = CacheEngine(mc, sizes, bs, dtype, device, cpu_sizes, groups)
        self.block_manager = make_kv_manager(
            groups, sizes, bs, config.watermark, config.enable_prefix_caching
        )
        # the one step-cost model: the scheduler's pacing and the speculator's policy read it
        self.cost = StepCost(
            config.prefill_ms_while_decoding,
            config.prefill_ms_alone,
            attention_span(mc),
            config.prompt_logprob_cost,
        )
        self.scheduler = Scheduler.from_config(
            self.block_manager, config, cpu_sizes, self.cost, eos_token_ids, self.max_model_len
        )
        self.spec = build_speculator(
            config, self.cost, eos_token_ids, self.max_model_len, draft, sizes[0] * bs
        )
        self.matchers = Matchers(model_dir, mc.vocab_size, eos_token_ids, config.structured_index_at_start)
        self.compiling = PendingCompiles(config.structured_compile_timeout_s)  # their sequences wait here
        sampler = Sampler(mc.vocab_size, eos_token_ids, config.seed, device)
        self.runner = ModelRunner(model, self.cache.kv_caches, bs, device, static, sampler)
        self.adapters = Adapters(config, mc, model_name, device, self.runner.dtype)  # LoRA (docs/lora.md)
        side = model.image_side  # a model that sees: its images' rows at their placeholders
        cache = EncoderCache(int(config.encoder_cache_mb * (1 << 20)))
        self.images = EncoderStep(side, cache) if side is not None else None
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
    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request as it came from the wire. Raises ValueError, leaving the engine as
        it was, on what it cannot serve. A higher `priority` is admitted first; within a
        priority, `tenant`s share the batch by tokens served (see Scheduler). Its blocks are
        shared in its prefix-cache namespace (`prefix_hash.request_root`: its `cache_salt`),
        which its LoRA adapter `lora` (a name `adapters` holds; "": the base) extends."""
        params = request.params
        if params.pooling == "auto":  # an embedding request: this model's pooling
            params = dataclasses.replace(params, pooling=self.pooling)
        rid = request.request_id
        check_admissible(
            request, params, in_use=rid in self._requests, held=len(self._requests),
            vocab_size=self.vocab_size, max_model_len=self.max_model_len, bm=self.block_manager, config=self.config,
            sees=self.images is not None,
        )  # fmt: skip
        adapter = self.adapters.get(request.lora) if request.lora else None
        now = request.arrival_time or time.time()  # the gateway's: queue time counts the broker's
        req = Request.start(
            rid, request.prompt_token_ids, params, now, request.priority, request.tenant, self.eos_token_ids
        )
        root = adapter_root(request_root(request), adapter)
        images = tuple(request.images or ())
        spans = request_images(request)
        for seq in req.seqs:
            seq.cache_root, seq.lora = root, adapter
            seq.images, seq.image_spans = images, spans
        self._requests[rid] = req
        if params.structured is not None:  # compiled off this thread; step() schedules it when done
            self.compiling.add(rid, self.matchers.start(params.structured))
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
        self.spec.propose(self.scheduler)  # drafts into the running sequences, where they pay
        sched = self.scheduler.schedule()
        if sched.scheduled:
            self.cache.apply(sched.swap_out, sched.swap_in, sched.copies)
        rows = None
        if self.images is not None:  # a model that sees: its placeholders' rows (encoder_step.py)
            sched.scheduled, rows, failed = self.images.step_rows(sched.scheduled, sched.preempted)
            outputs += self._fail_each([(seq, ERR_INVALID_REQUEST, why) for seq, why in failed])
        if sched.scheduled:
            want, pool = self._want(sched.scheduled)
            output = self.runner.run(sched.scheduled, runner_tables(self.block_manager), want, pool, rows)
            self._keep(output)  # prompt logprobs and pooled vectors, before the blocks move
            update = self.scheduler.update_from_output(sched, output)
            if self.images is not None:
                self.images.settle(sched.scheduled)  # prompts whose images are computed release them
            self.spec.record(update, [seq for seq, _ in sched.scheduled if seq.finished])
            self.cost.observe(sched.work, time.perf_counter() - started)
            outputs += self._report(sched.scheduled, output, update)
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
            kv_bytes_used=kv_bytes_used(bm, self.cache.block_bytes),
            kv_bytes_total=self.cache.kv_bytes,
            **(self.images.cache.counts() if self.images is not None else {}),
        )

    # -- around the step's three calls -------------------------------------------
    def _want(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[dict[int, int] | None, dict[int, str] | None]:
        """seq_id -> top N for the sequences whose prompt logprobs are not all computed, and
        seq_id -> pooling for the embedding requests (None where none)."""
        want: dict[int, int] = {}
        pool: dict[int, str] = {}
        for seq, _ in scheduled:
            if seq.params.pooling:
                pool[seq.seq_id] = seq.params.pooling
            req = self._requests.get(seq.request_id)
            if req is not None and seq.params.prompt_logprobs is not None and req.wants_prompt_logprobs():
                want[seq.seq_id] = seq.params.prompt_logprobs
        return want or None, pool or None

    def _keep(self, output: ModelOutput) -> None:
        """The prompt logprobs and pooled chunks this step computed, kept by their requests."""
        for c in output.prompt_logprobs:
            if (req := self._requests.get(c.seq.request_id)) is not None:
                req.keep_prompt_logprobs(c.first, c.entries)
        for p in output.pooled:
            if (req := self._requests.get(p.seq.request_id)) is not None:
                req.keep_pooled(p.start, p.num_tokens, p.vector, p.caught_up)

    def _report(
        self, scheduled: list[tuple[Sequence, int]], output: ModelOutput, update: StepUpdate
    ) -> list[RequestOutput]:
        """Every request that got tokens or ended in this step: the failed ones, finished
        beam searches and embeddings (their blocks freed now), then the others' new tokens."""
        outputs = self._fail_each(update.failed)
        outputs += [self._beam_output(self._requests[r]) for r in update.searched if r in self._requests]
        for p in output.pooled:
            req = self._requests.get(p.seq.request_id)
            if req is not None and p.caught_up:  # never sampled: its blocks are freed now
                del self._requests[req.request_id]
                self._end(req, FINISH_STOP)
                outputs.append(req.output())
        return outputs + self._collect(scheduled)

    def _beam_output(self, req: Request) -> RequestOutput:
        del self._requests[req.request_id]
        return req.beam_output()

    def _end(self, req: Request, reason: str) -> None:
        """Finish every choice of `req` now, freeing its blocks (and its images' rows)."""
        if self.images is not None:
            self.images.release(req.request_id)
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
