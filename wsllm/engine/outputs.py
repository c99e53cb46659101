"""What `LLMEngine.step()` returns. Torch-free, so the worker and `bench/` import it
without pulling in the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int  # the choice (n > 1) or the rank of a beam hypothesis
    new_token_ids: list[int]  # produced in this step
    num_tokens: int  # output tokens so far, this step's included
    finish_reason: str | None = None
    new_logprobs: list[Any] | None = None  # per new token: [chosen_logprob, [[tok, lp], ...]]
    # Every output token, filled once the choice has finished (never copied per step).
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    queue_time: float | None = None  # seconds from arrival to first schedule, on the first output
    # Once, on the first output after the prompt is computed (params.prompt_logprobs set):
    # per prompt token, None for the first, else (logprob, ((tok, lp), ...top N))
    prompt_logprobs: list[Any] | None = None
    # Set when the engine could not serve this request (its other outputs are empty):
    # a machine-readable code and a message a person can read.
    error_code: str | None = None
    error: str | None = None
    # An embedding request's pooled last hidden state (fp32, not normalized), on its one
    # output: params.pooling set.
    embedding: list[float] | None = None
    # Speculative decoding, over every choice so far: draft tokens verified and accepted
    num_drafted: int = 0
    num_accepted: int = 0


@dataclass(slots=True)
class EngineStats:
    """What `LLMEngine.stats()` reports. The worker sends it with each heartbeat (as a
    JSON object: `EngineInfo.stats`), where the gateway's gauges and /ready read it."""

    num_running: int  # requests with a running sequence
    num_waiting: int  # requests with a sequence waiting for its (re)admission
    num_swapped: int  # requests with a sequence swapped out to CPU blocks
    kv_usage: float  # share of the KV blocks in use, 0..1
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since the engine started (as are all the counters below)
    num_swaps: int  # swaps out and in
    num_cow: int  # copy-on-write block copies
    num_aborted_total: int
    prefix_hit_rate: float  # prompt tokens served by the prefix cache / prompt tokens looked up
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    num_steps: int
    # Speculative decoding (--speculative): draft tokens verified, of them accepted, and the
    # verifications (a sequence's row of drafts in a step): tokens per verification = 1 +
    # accepted / verifications, the mean accepted length
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    # KV bytes the sequences hold now (each KV group's used blocks at its block's bytes: a
    # windowed group's given-back blocks not counted) and the device KV cache's bytes in all
    kv_bytes_used: int = 0
    kv_bytes_total: int = 0
    # A model that sees (engine/encoder_cache.py): images the encoder ran for, images served by
    # the encoder cache, its bytes now (an image whose placeholders hit the prefix cache is neither)
    encoder_runs: int = 0
    encoder_hits: int = 0
    encoder_cache_bytes: int = 0


__all__ = ["CompletionOutput", "EngineStats", "RequestOutput"]
