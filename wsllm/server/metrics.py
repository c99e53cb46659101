"""Prometheus metrics of one gateway (its own registry, so that several apps can live
in one process, as they do in tests)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    60.0,
)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.ttft = hist("wsllm_time_to_first_token_seconds", "Arrival to first text sent", _LATENCY_BUCKETS)
        self.itl = hist("wsllm_inter_token_latency_seconds", "Time between token events", _LATENCY_BUCKETS)
        self.e2e = hist("wsllm_e2e_request_latency_seconds", "Arrival to the end of a request", _E2E_BUCKETS)
        self.queue = hist(
            "wsllm_request_queue_time_seconds", "Arrival to first engine schedule", _E2E_BUCKETS
        )
        self.prompt_tokens = Counter("wsllm_prompt_tokens", "Prompt tokens", labels, registry=r).labels(
            model_name
        )
        self.generation_tokens = Counter(
            "wsllm_generation_tokens", "Generated tokens", labels, registry=r
        ).labels(model_name)
        self._requests = Counter(
            "wsllm_requests", "Finished requests", ["model", "api", "finish_reason"], registry=r
        )
        self.aborts = Counter("wsllm_request_aborts", "Requests aborted", labels, registry=r).labels(
            model_name
        )
        self._errors = Counter(
            "wsllm_request_errors", "Requests failed or refused", ["model", "code"], registry=r
        )
        self.running = Gauge(
            "wsllm_num_requests_running", "Requests the engines run", labels, registry=r
        ).labels(model_name)
        self.waiting = Gauge(
            "wsllm_num_requests_waiting", "Requests waiting in the broker and the engines", labels, registry=r
        ).labels(model_name)
        self.kv_usage = Gauge(
            "wsllm_kv_cache_usage_ratio", "KV cache in use (0..1)", labels, registry=r
        ).labels(model_name)
        # Engine-side figures, from the heartbeats (summed over engines).
        self.prefix_hit_rate = Gauge(
            "wsllm_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache (0..1)",
            labels,
            registry=r,
        ).labels(model_name)
        self.engine_preemptions = Gauge(
            "wsllm_engine_preemptions", "Sequences preempted since the engines started", labels, registry=r
        ).labels(model_name)
        self.engine_aborts = Gauge(
            "wsllm_engine_aborted_requests",
            "Requests the engines aborted since they started",
            labels,
            registry=r,
        ).labels(model_name)
        self.model_name = model_name
        self._isolation_metrics()

    def _isolation_metrics(self) -> None:
        """Slow clients cut off, the event reader's restarts, what is buffered."""
        r, labels = self.registry, ["model"]
        self._send_timeouts = Counter(
            "wsllm_send_timeouts",
            "Clients disconnected because they took no data for --send-timeout-s",
            ["model", "transport"],
            registry=r,
        )
        self.reader_restarts = Gauge(
            "wsllm_event_reader_restarts",
            "Times the event reader failed and was restarted",
            labels,
            registry=r,
        ).labels(self.model_name)
        self.buffered_events = Gauge(
            "wsllm_buffered_events", "Events held for clients that have not read them yet", labels, registry=r
        ).labels(self.model_name)

    def send_timeout(self, transport: str) -> None:
        self._send_timeouts.labels(self.model_name, transport).inc()

    def finished(self, api: str, finish_reason: str) -> None:
        self._requests.labels(self.model_name, api, finish_reason).inc()

    def error(self, code: str) -> None:
        self._errors.labels(self.model_name, code).inc()

    def set_engine_stats(self, stats: list[dict[str, Any]], pending: int) -> None:
        """Gauges from the engines' heartbeats, summed (KV use: the mean)."""
        self.running.set(sum(s.get("num_running", 0) for s in stats))
        self.waiting.set(pending + sum(s.get("num_waiting", 0) + s.get("num_swapped", 0) for s in stats))
        self.kv_usage.set(sum(s.get("kv_usage", 0.0) for s in stats) / len(stats) if stats else 0.0)
        hits = sum(s.get("prefix_hit_tokens", 0) for s in stats)
        queried = sum(s.get("prefix_queried_tokens", 0) for s in stats)
        self.prefix_hit_rate.set(hits / queried if queried else 0.0)
        self.engine_preemptions.set(sum(s.get("num_preemptions", 0) for s in stats))
        self.engine_aborts.set(sum(s.get("num_aborted_total", 0) for s in stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
