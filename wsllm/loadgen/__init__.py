"""`wsllm bench`: a load generator for any OpenAI-compatible server (SSE) or wsllm's
WebSocket, measuring what vLLM's `bench serve` measures, with its definitions.

This module holds only the options (so that `wsllm.cli` stays light); the work is in
`runner` (load), `clients` (SSE and WS), `prompts`, `report` (figures, table) and
`plots`. Nothing here imports torch or the engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(slots=True)
class BenchConfig:
    base_url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "server root (with or without /v1)"}
    )
    model: str | None = field(
        default=None, metadata={"help": "model id to send; default: the first of /v1/models"}
    )
    transport: str = field(
        default="sse", metadata={"help": "sse (any OpenAI-compatible server) | ws (wsllm's /v1/ws)"}
    )
    endpoint: str = field(default="completions", metadata={"help": "completions | chat"})
    concurrency: str = field(
        default="",
        metadata={
            "help": "requests in flight, a comma list runs each level: 1,8,32 (default 1; unbounded with --request-rate)"
        },
    )
    request_rate: float | None = field(
        default=None, metadata={"help": "requests/s with Poisson arrivals; default: all at once"}
    )
    num_requests: int = field(default=64, metadata={"help": "requests per concurrency level"})
    input_len: int = field(
        default=128, metadata={"help": "synthetic prompt length in tokens (words without --tokenizer)"}
    )
    output_len: int = field(default=128, metadata={"help": "max_tokens of each request"})
    prompts: str | None = field(
        default=None,
        metadata={"help": 'JSONL file of prompts ({"prompt"} or {"messages"}, optional "max_tokens")'},
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer dir (tokenizer.json) for exact synthetic prompt lengths"}
    )
    ignore_eos: bool = field(
        default=False,
        metadata={"help": "send ignore_eos (vLLM / wsllm extension) so every request runs output_len tokens"},
    )
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature sent with each request"})
    top_p: float = field(default=1.0, metadata={"help": "top_p sent with each request (1: not sent)"})
    top_k: int = field(default=0, metadata={"help": "top_k sent with each request (0: not sent)"})
    seed: int = field(default=0, metadata={"help": "seed for prompts and arrival times"})
    timeout_s: float = field(
        default=600.0, metadata={"help": "give up on one request after this many seconds"}
    )
    json: str | None = field(default=None, metadata={"help": "write the results as JSON to this path"})
    plot: str | None = field(
        default=None,
        metadata={"help": "write PNG plots (latency CDF, throughput vs concurrency) to this dir"},
    )
    api_key: str | None = field(default=None, metadata={"help": "bearer key sent to the server"})

    def __post_init__(self) -> None:
        if self.transport not in ("sse", "ws"):
            raise ValueError(f"transport must be sse or ws, got {self.transport!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, input_len and output_len must be >= 1")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.temperature < 0:
            raise ValueError("temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        levels = self.levels()
        if any(c < 1 for c in levels if c is not None):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency!r}")

    def levels(self) -> list[int | None]:
        """Concurrency levels to run, in order; None is unbounded (rate-limited only)."""
        if not self.concurrency.strip():
            return [None] if self.request_rate is not None else [1]
        try:
            return [int(c) for c in self.concurrency.split(",") if c.strip()]
        except ValueError:
            raise ValueError(
                f"concurrency must be a comma list of integers, got {self.concurrency!r}"
            ) from None


def run(args: argparse.Namespace) -> int:
    """The `wsllm bench` subcommand."""
    from wsllm.config import from_args
    from wsllm.loadgen.runner import main

    return main(from_args(BenchConfig, args))
