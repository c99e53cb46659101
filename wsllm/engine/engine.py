"""LLMEngine: one step = schedule -> run the model -> sample -> postprocess.

Contract: `add_request`, `abort`, `step() -> list[RequestOutput]`,
`has_unfinished()`, `free_capacity()`. Queues, blocks and tensors stay private.
The engine is not thread-safe: one thread (the worker) drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wsllm.config import EngineConfig
from wsllm.engine.beam import BeamSearcher, BeamState
from wsllm.engine.block_manager import BlockManager
from wsllm.engine.cache_engine import CacheEngine, num_blocks_for_budget
from wsllm.engine.model_runner import ModelRunner, PromptLogprobs
from wsllm.engine.outputs import CompletionOutput, RequestOutput
from wsllm.engine.sampler import Sampler
from wsllm.engine.scheduler import Scheduler
from wsllm.engine.sequence import SeqStatus, Sequence
from wsllm.models.build import build_model
from wsllm.models.llama import LlamaForCausalLM
from wsllm.structured import Matchers
from wsllm.types import (
    ERR_INTERNAL,
    ERR_INVALID_REQUEST,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineBusy,
    SamplingParams,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    pending: list[Sequence] = field(default_factory=list)  # choices not forked yet
    beam: BeamState | None = None
    beam_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> row, this round
    reported_queue_time: bool = False
    # params.prompt_logprobs: per prompt token so far ([None] for the first); None when not
    # asked for or once reported
    prompt_logprobs: list[Any] | None = None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
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
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        bs = config.block_size
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            num_blocks = num_blocks_for_budget(mc, bs, dtype, free * config.gpu_memory_utilization)
        else:
            num_blocks = num_blocks_for_budget(mc, bs, dtype, config.kv_cache_gb * 2**30)
        num_cpu = (
            num_blocks_for_budget(mc, bs, dtype, config.swap_space_gb * 2**30)
            if config.preemption_mode == "swap"
            else 0
        )
        self.cache = CacheEngine(mc, num_blocks, bs, dtype, device, num_cpu)
        self.block_manager = BlockManager(num_blocks, bs, config.watermark, config.enable_prefix_caching)
        swapper = None
        if num_cpu:
            from wsllm.engine.swap import CpuSwapSpace

            swapper = CpuSwapSpace(num_cpu)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.preemption_mode,
            swapper,
        )
        self.sampler = Sampler(mc.vocab_size, eos_token_ids, config.seed)
        self.matchers = Matchers(model_dir, mc.vocab_size, eos_token_ids)  # loads nothing until used
        self.beams = BeamSearcher(self.scheduler, mc.vocab_size)
        self.runner = ModelRunner(model, self.cache.kv_caches, bs, device)
        self._requests: dict[str, _Request] = {}
        self._aborted: list[_Request] = []
        self.num_aborted_total = 0
        self.num_steps = 0
        self.step_log: list[dict[str, int]] = []  # {request_id: num_tokens} per step, when enabled
        self.record_steps = False

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
    ) -> None:
        """Queue a request. Raises ValueError, leaving the engine as it was, on bad input.
        A higher `priority` is admitted first; within a priority, `tenant`s share the
        batch by tokens served (see Scheduler)."""
        self._validate(request_id, prompt_token_ids, params)
        # the spec compiles (or raises ValueError) here; choices 1..n-1 copy choice 0's matcher
        matcher = self.matchers.new(params.structured) if params.structured is not None else None
        now = arrival_time if arrival_time is not None else time.time()
        req = _Request(request_id, list(prompt_token_ids), params)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        for i in range(params.n):
            seq = Sequence(request_id, i, req.prompt_token_ids, params, now, priority=priority, tenant=tenant)
            req.seqs.append(seq)
        req.seqs[0].matcher = matcher
        self._requests[request_id] = req
        if params.use_beam_search:
            req.seqs = req.seqs[:1]
            req.beam = BeamState(
                params.beam_width,
                params.length_penalty,
                params.early_stopping,
                params.max_tokens,
                [] if params.ignore_eos else self.eos_token_ids,
            )
        else:  # choices 1..n-1 fork from choice 0 once its prompt is computed
            req.pending = req.seqs[1:]
        self.scheduler.add(req.seqs[0])

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not prompt:
            raise ValueError("prompt must not be empty")
        if any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab_size for t in prompt
        ):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
        if params.logit_bias and any(t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is {total}, "
                f"beyond the model's context of {self.max_model_len} tokens"
            )
        bm = self.block_manager
        if bm.blocks_for(total) > bm.num_blocks - bm.watermark_blocks:
            raise ValueError(
                f"prompt plus max_tokens ({total} tokens) needs more KV blocks than the cache has "
                f"({bm.num_blocks} blocks of {bm.block_size})"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) must be <= max_num_seqs ({self.config.max_num_seqs})")
        if params.use_beam_search and params.n > params.beam_width:
            raise ValueError(f"n ({params.n}) must be <= beam_width ({params.beam_width}) with beam search")
        if params.use_beam_search and params.beam_width > self.config.max_num_seqs:
            raise ValueError(f"beam_width must be <= max_num_seqs ({self.config.max_num_seqs})")
        if len(self._requests) >= self.config.max_waiting + self.config.max_num_seqs:
            raise EngineBusy("the engine is full; retry later")

    def abort(self, request_id: str) -> bool:
        """Stop a request now. Its blocks are freed before this returns; the next
        step() reports it with finish_reason 'abort'."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = FINISH_ABORT
            seq.matcher = None
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
        waiting = len(s.waiting) + len(s.swapped)
        room = self.config.max_num_seqs - len(s.running) - waiting
        bm = self.block_manager
        avg = max(1, bm.blocks_for(256))
        kv_room = (bm.num_free_blocks - bm.watermark_blocks) // avg - waiting
        return max(0, min(room, max(kv_room, 1 if not s.running and not waiting else 0)))

    def step(self) -> list[RequestOutput]:
        outputs = self._flush_aborted()
        sched = self.scheduler.schedule()
        self.cache.apply(sched.swap_out, sched.swap_in, sched.copies)
        if sched.scheduled:
            if self.record_steps:
                self.step_log.append({f"{s.request_id}/{s.index}": n for s, n in sched.scheduled})
            seqs, logits, prompt = self.runner.run(
                sched.scheduled, self.block_manager.block_tables, self._want_prompt_logprobs(sched.scheduled)
            )
            self._keep_prompt_logprobs(prompt)
            outputs += self._sample(seqs, logits)
            self.scheduler.finish_step(sched.scheduled)
            outputs += self._collect(sched.scheduled)
        self.num_steps += 1
        return outputs

    # -- internals ----------------------------------------------------------
    def _want_prompt_logprobs(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int] | None:
        """seq_id -> top N, for the sequences whose prompt logprobs are not all computed."""
        want = None
        for seq, _ in scheduled:
            if seq.params.prompt_logprobs is None:
                continue
            req = self._requests.get(seq.request_id)
            plp = None if req is None else req.prompt_logprobs
            if req is not None and plp is not None and len(plp) < len(req.prompt_token_ids):
                want = want or {}
                want[seq.seq_id] = seq.params.prompt_logprobs
        return want

    def _keep_prompt_logprobs(self, computed: list[PromptLogprobs]) -> None:
        for c in computed:
            req = self._requests.get(c.seq.request_id)
            if req is None or req.prompt_logprobs is None:
                continue
            have = len(req.prompt_logprobs)
            if c.first <= have:  # a recompute after preemption repeats the ones it has
                req.prompt_logprobs += c.entries[have - c.first :]

    @staticmethod
    def _take_prompt_logprobs(req: _Request) -> list[Any] | None:
        """The prompt logprobs, once, when every prompt token has its entry."""
        plp = req.prompt_logprobs
        if plp is None or len(plp) < len(req.prompt_token_ids):
            return None
        req.prompt_logprobs = None
        return plp

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[RequestOutput]:
        """Next tokens for the rows that caught up: beams advance their search, n > 1
        choices fork, the rest go through the batched sampler. Returns the outputs of
        requests that ended here (beam searches, requests whose sampling failed)."""
        outputs: list[RequestOutput] = []
        if logits is None:
            return outputs
        seqs, rest, advanced = self.beams.split(seqs, logits, self._requests)
        outputs += [self._beam_output(req) for req in advanced if req.beam and req.beam.done]  # type: ignore[arg-type]
        if rest is None or not seqs:
            return outputs
        seqs, rest = self._fork_children(seqs, rest)
        result, failed = self.sampler.sample_isolated(rest, seqs)
        bad = [(seqs[i], ERR_INTERNAL, reason) for i, reason in failed.items()]
        for i, (seq, tok, lp) in enumerate(zip(seqs, result.token_ids, result.logprobs, strict=True)):
            if i not in failed and (error := self._append_token(seq, tok, lp)):
                bad.append((seq, ERR_INVALID_REQUEST, error))
        for seq, code, reason in bad:
            req = self._requests.get(seq.request_id)
            if req is not None:
                outputs.append(self._fail(req, code, reason))
        return outputs

    def _beam_output(self, req: _Request) -> RequestOutput:
        assert req.beam is not None
        del self._requests[req.request_id]
        comps = [
            CompletionOutput(
                i,
                list(h.token_ids),
                len(h.token_ids),
                FINISH_STOP if h.stopped_by_eos else FINISH_LENGTH,
                token_ids=h.token_ids,
            )
            for i, h in enumerate(req.beam.best(req.params.n))
        ]
        first = req.seqs[0]
        qt = max(0.0, (first.first_scheduled_time or first.arrival_time) - first.arrival_time)
        return RequestOutput(
            req.request_id,
            len(req.prompt_token_ids),
            comps,
            True,
            first.num_cached_tokens,
            qt,
            prompt_logprobs=self._take_prompt_logprobs(req),
        )

    def _fork_children(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """n > 1: when the first choice finishes its prompt, the other choices fork
        from it, sharing its blocks, and sample their first token from its logits."""
        rows: list[int] = []
        out: list[Sequence] = []
        for i, seq in enumerate(seqs):
            rows.append(i)
            out.append(seq)
            req = self._requests.get(seq.request_id)
            if req is None or not req.pending or seq is not req.seqs[0]:
                continue
            for child in req.pending:
                self.scheduler.fork(seq, child)
                rows.append(i)
                out.append(child)
            req.pending = []
        if len(out) == len(seqs):
            return seqs, logits
        return out, logits[torch.tensor(rows)]

    def _fail(self, req: _Request, code: str, message: str) -> RequestOutput:
        """End a request the engine could not serve, freeing its blocks now."""
        self._requests.pop(req.request_id, None)
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = FINISH_ERROR
            seq.matcher = None
        out = self._output(req)
        out.error_code, out.error = code, message
        return out

    def _append_token(self, seq: Sequence, tok: int, lp: Any) -> str | None:
        """Add a sampled token and decide whether the sequence ends. Returns why its
        request must fail, when its grammar could not take the token."""
        seq.output_token_ids.append(tok)
        seq.new_token_ids.append(tok)
        if lp is not None:
            seq.new_logprobs.append(lp)
            seq.cumulative_logprob += lp[0]
        p = seq.params
        n_out = len(seq.output_token_ids)
        complete = False  # a grammar that takes nothing more (its EOS included) ends it
        if seq.matcher is not None:
            # (an errored matcher allows only EOS, and may take it: is_error says)
            if not seq.matcher.consume_token(tok) or seq.matcher.is_error():
                return f"structured output failed: {seq.matcher.get_error() or 'the grammar refused a token'}"
            complete = seq.matcher.is_stopped()
        if complete or (
            n_out >= p.min_tokens
            and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids))
        ):
            seq.finish_reason = FINISH_STOP
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FINISH_LENGTH
        if seq.finish_reason is not None:
            seq.status = SeqStatus.FINISHED
            seq.matcher = None
        return None

    def _collect(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        touched: dict[str, _Request] = {}
        for seq, _ in scheduled:
            if seq.new_token_ids and seq.request_id in self._requests:
                touched[seq.request_id] = self._requests[seq.request_id]
        outs = []
        for rid, req in touched.items():
            outs.append(self._output(req))
            if outs[-1].finished:
                del self._requests[rid]
        return outs

    def _output(self, req: _Request) -> RequestOutput:
        comps = []
        for s in req.seqs:
            comps.append(
                CompletionOutput(
                    s.index,
                    s.new_token_ids,
                    len(s.output_token_ids),
                    s.finish_reason,
                    s.new_logprobs if s.params.logprobs is not None else None,
                    list(s.output_token_ids) if s.finished else [],
                )
            )
            s.new_token_ids = []
            s.new_logprobs = []
        qt = None
        first = req.seqs[0]
        if not req.reported_queue_time and first.first_scheduled_time is not None:
            qt = max(0.0, first.first_scheduled_time - first.arrival_time)
            req.reported_queue_time = True
        return RequestOutput(
            req.request_id,
            len(req.prompt_token_ids),
            comps,
            all(s.finished for s in req.seqs),
            first.num_cached_tokens,
            qt,
            prompt_logprobs=self._take_prompt_logprobs(req),
        )

    def _flush_aborted(self) -> list[RequestOutput]:
        outs = [self._output(r) for r in self._aborted]
        self._aborted.clear()
        return outs

    def stats(self) -> dict[str, Any]:
        s, bm = self.scheduler, self.block_manager
        return {
            "num_running": len({q.request_id for q in s.running}),
            "num_waiting": len({q.request_id for q in s.waiting}),
            "num_swapped": len({q.request_id for q in s.swapped}),
            "kv_usage": bm.usage(),
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_preemptions": s.num_preemptions,
            "num_swaps": s.num_swaps,
            "num_cow": bm.num_cow,
            "num_aborted_total": self.num_aborted_total,
            "prefix_hit_rate": bm.hit_rate,
            "prefix_hit_tokens": bm.hit_tokens,
            "prefix_queried_tokens": bm.queried_tokens,
            "num_steps": self.num_steps,
        }


__all__ = ["LLMEngine", "RequestOutput", "CompletionOutput"]
