"""The gateway's settings (`GatewayConfig`): limits, timeouts and what it serves; its
flags and `WSLLM_*` variables are derived by `wsllm.config.add_arguments` / `from_args`."""

from __future__ import annotations

from dataclasses import dataclass, field

from wsllm.bounds import MAX_WIRE_IMAGE_BYTES


def tool_parser_choices() -> tuple[str, ...]:
    """GatewayConfig.tool_parser's values: auto, or a style of the registry."""
    # Imported on use: the engine reads this module too and must not load server code.
    from wsllm.server.chat.registry import style_names

    return ("auto", *style_names())


@dataclass(slots=True)
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(default=None, metadata={"help": "require this bearer key on every route"})
    api_keys_file: str | None = field(
        default=None,
        metadata={"help": "TOML file of tenants: their keys and limits (docs/deployment.md)"},
    )
    allowed_origins: str = field(
        default="", metadata={"help": "comma list of WS origins; empty = same-origin"}
    )
    # The anonymous tenant: every client of a gateway that requires no key shares these.
    anonymous_rpm: int = field(
        default=3000, metadata={"help": "requests per minute of all keyless clients together; 0: unlimited"}
    )
    anonymous_tpm: int = field(
        default=4_000_000,
        metadata={"help": "prompt + completion tokens per minute of all keyless clients; 0: unlimited"},
    )
    anonymous_max_concurrent: int = field(
        default=128, metadata={"help": "requests in flight at once of all keyless clients; 0: unlimited"}
    )
    anonymous_operator: bool = field(
        default=False,
        metadata={
            "help": "on a gateway that requires no key, every client is the operator (may load and unload LoRA "
            "adapters); off: nobody there may"
        },
    )
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "largest HTTP body"})
    max_ws_message_bytes: int = field(default=1 << 20, metadata={"help": "largest WS message"})
    max_tokens_limit: int = field(default=4096, metadata={"help": "largest max_tokens accepted"})
    default_max_tokens: int = field(default=512, metadata={"help": "max_tokens when the client names none"})
    max_n: int = field(default=8, metadata={"help": "largest n accepted"})
    max_stop: int = field(default=8, metadata={"help": "most stop strings"})
    max_stop_len: int = field(default=128, metadata={"help": "longest stop string"})
    max_top_logprobs: int = field(default=20, metadata={"help": "largest top_logprobs"})
    text_work_threads: int = field(
        default=1,
        metadata={
            "help": "threads for a request's heavy text work (long tokenizations, large bodies, "
            "prompt-logprobs tables): more queue, they never take every core from the engine"
        },
    )
    text_work_nice: int = field(
        default=10, metadata={"help": "how far below the server's CPU priority heavy text work runs (Linux)"}
    )
    template_threads: int = field(
        default=2,
        metadata={
            "help": "threads that render chat templates (below the server's priority by --text-work-nice, "
            "taking tenants in turn): more wait"
        },
    )
    spec_check_workers: int = field(
        default=1,
        metadata={
            "help": "processes that check structured-output specs (niced, taking tenants in turn); one past its "
            "deadline is killed and replaced"
        },
    )
    template_timeout_s: float = field(
        default=5.0,
        metadata={"help": "longest a chat template may render (and tokenize) one request: 400 past it"},
    )
    spec_check_timeout_s: float = field(
        default=5.0,
        metadata={
            "help": "longest a structured-output spec may take to check (waiting included): 400 past it"
        },
    )
    spec_compile_tokens_per_s: int = field(
        default=2000,
        metadata={
            "help": "tokens charged to the tenant per second the gateway spent compiling a request's "
            "structured-output spec (about what a second of prefill computes on a small CPU); 0: free"
        },
    )
    max_prompt_logprobs: int = field(
        default=65536,
        metadata={"help": "largest prompt-logprobs table: prompt tokens x (prompt_logprobs + 1) entries"},
    )
    max_messages: int = field(default=1024, metadata={"help": "most chat messages in one request"})
    max_prompts: int = field(
        default=16, metadata={"help": "most prompts in one /v1/completions call (a list of prompts)"}
    )
    max_requests_per_socket: int = field(
        default=32, metadata={"help": "concurrent requests (started or resumed) per WebSocket"}
    )
    # Images (docs/vision.md): each checked in the gateway before any work for it.
    max_image_bytes: int = field(
        default=5 << 20,
        metadata={"help": "largest image file (its bytes, before base64); the body limit too"},
    )
    max_image_pixels: int = field(
        default=4096 * 4096,
        metadata={"help": "most pixels (width x height) of one image, read from its header"},
    )
    max_images_per_request: int = field(default=8, metadata={"help": "most images in one request's body"})
    max_request_image_bytes: int = field(
        default=16 << 20,
        metadata={
            "help": "most bytes of image files one request carries to an engine across the broker "
            "(its conversation's images all told; at most 64 MiB)"
        },
    )
    max_images_per_conversation: int = field(
        default=16,
        metadata={
            "help": "most images a model reads for one answer (a stored Responses conversation included)"
        },
    )
    max_sockets_per_tenant: int = field(
        default=32,
        metadata={
            "help": "WebSockets one tenant may hold open on this gateway (a handshake past it: close 1013)"
        },
    )
    max_sockets: int = field(
        default=1024,
        metadata={
            "help": "WebSockets open on this gateway, every tenant's (about 85 KB each; past it: close 1013)"
        },
    )
    metrics_cache_s: float = field(
        default=1.0,
        metadata={
            "help": "a key without the metrics role gets /metrics rendered at most this often (its view's)"
        },
    )
    max_queue_depth: int = field(default=256, metadata={"help": "requests waiting before 429"})
    max_queue_share: float = field(
        default=0.5,
        metadata={
            "help": "the fraction of max_queue_depth one tenant's waiting requests may fill (429 for that "
            "tenant only past it); 1: no per-tenant share"
        },
    )
    max_priority: int = field(
        default=0,
        metadata={"help": "highest `priority` a request may ask for, unless its tenant's max_priority says"},
    )
    queue_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "a request still waiting for an engine after this long ends with 503 queue_timeout; 0: never"
        },
    )
    orphan_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "a followed request ends with 503 worker_lost when its model has had no live engine, or (once "
            "it started) no event came for it, for this long (docs/reliability.md)"
        },
    )
    max_buffered_events: int = field(
        default=512,
        metadata={
            "help": "events held for one request whose client does not read; past it the request fails"
        },
    )
    ws_outbox_messages: int = field(
        default=256, metadata={"help": "messages queued for one WebSocket's writer"}
    )
    send_timeout_s: float = field(
        default=30.0, metadata={"help": "a client that takes no data for this long is disconnected"}
    )
    heartbeat_s: float = field(default=10.0, metadata={"help": "SSE comment / WS ping interval"})
    allowed_hosts: str = field(
        default="",
        metadata={"help": "comma list of Host names served; empty = loopback names and --host; * = any"},
    )
    frontend: bool = field(default=True, metadata={"help": "serve the chat UI at /"})
    response_ttl_s: float = field(
        default=3600.0,
        metadata={
            "help": "how long a stored /v1/responses answer stays readable (previous_response_id, GET)"
        },
    )
    response_tenant_max_bytes: int = field(
        default=16 << 20,
        metadata={
            "help": "bytes of stored /v1/responses answers one tenant keeps at once: past it its own oldest go"
        },
    )
    response_tenant_max_records: int = field(
        default=1000,
        metadata={"help": "stored /v1/responses answers one tenant keeps at once: past it its own oldest go"},
    )
    max_embedding_inputs: int = field(
        default=64,
        metadata={"help": "most inputs in one /v1/embeddings call (each a request of its own in the queue)"},
    )
    tool_parser: str = field(
        default="auto",
        metadata={
            "help": "the tool-call style chat output is read in: auto (from the model's chat template and name)",
            "choices": tool_parser_choices,
        },
    )

    def __post_init__(self) -> None:
        if self.tool_parser not in (choices := tool_parser_choices()):
            raise ValueError(f"tool_parser must be one of {', '.join(choices)}, got {self.tool_parser!r}")
        positive = (
            "max_messages",
            "max_image_bytes",
            "max_image_pixels",
            "max_images_per_request",
            "max_images_per_conversation",
            "max_requests_per_socket",
            "max_sockets_per_tenant",
            "max_sockets",
            "max_buffered_events",
            "ws_outbox_messages",
            "max_embedding_inputs",
            "response_tenant_max_bytes",
            "response_tenant_max_records",
            "template_threads",
            "spec_check_workers",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_request_image_bytes <= MAX_WIRE_IMAGE_BYTES:
            raise ValueError(f"max_request_image_bytes must be in [1, {MAX_WIRE_IMAGE_BYTES}]")
        if not 0 <= self.metrics_cache_s <= 3600:
            raise ValueError(f"metrics_cache_s must be in [0, 3600] seconds, got {self.metrics_cache_s}")
        if not self.send_timeout_s > 0 or not self.heartbeat_s > 0:
            raise ValueError("send_timeout_s and heartbeat_s must be > 0")
        if self.text_work_threads < 1 or not 0 <= self.text_work_nice <= 19:
            raise ValueError("text_work_threads must be >= 1 and text_work_nice in [0, 19]")
        if not self.template_timeout_s > 0 or not self.spec_check_timeout_s > 0:
            raise ValueError("template_timeout_s and spec_check_timeout_s must be > 0")
        if not 0 < self.response_ttl_s <= 1e7:
            raise ValueError(f"response_ttl_s must be in (0, 1e7] seconds, got {self.response_ttl_s}")
        if not 0 < self.orphan_timeout_s <= 1e6:
            raise ValueError(f"orphan_timeout_s must be in (0, 1e6] seconds, got {self.orphan_timeout_s}")
        for name in ("anonymous_rpm", "anonymous_tpm", "anonymous_max_concurrent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: unlimited), got {getattr(self, name)}")
        if not 0 <= self.queue_timeout_s <= 1e6:
            raise ValueError(f"queue_timeout_s must be in [0, 1e6] seconds, got {self.queue_timeout_s}")
        if not 0 < self.max_queue_share <= 1:
            raise ValueError(f"max_queue_share must be in (0, 1], got {self.max_queue_share}")
