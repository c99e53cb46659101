"""Prometheus metrics of one gateway (its own registry, so that several apps can live
in one process, as they do in tests). A key sees the samples of the models it may use
only (`render`); an operator's key (the `metrics` role) sees every model's.

The per-tenant families live in a registry of their own, which /metrics adds only for
an operator's key (the `metrics` role): tenant names and their usage are not for
every key. A tenant sees its own figures through `GET /v1/usage` (`tenant_usage`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

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


# (EngineStats field, metric name after wsllm_spec_, help)
SPEC_GAUGES = (
    ("spec_draft_tokens", "draft_tokens", "Draft tokens the engines verified since they started"),
    ("spec_accepted_tokens", "accepted_tokens", "Draft tokens the engines accepted since they started"),
    ("spec_verifications", "verifications", "Rows of drafts the engines verified since they started"),
)


class _Families:
    """The metric families of one gateway, in its own registry; `Metrics` binds them to
    one model. Label values come only from the models engines register and the tenants
    of the keys file, never from a request's text."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, m, registry=r, buckets=buckets)

        self.ttft = hist("wsllm_time_to_first_token_seconds", "Arrival to first text sent", _LATENCY_BUCKETS)
        self.itl = hist("wsllm_inter_token_latency_seconds", "Time between token events", _LATENCY_BUCKETS)
        self.e2e = hist("wsllm_e2e_request_latency_seconds", "Arrival to the end of a request", _E2E_BUCKETS)
        self.queue = hist(
            "wsllm_request_queue_time_seconds", "Arrival to first engine schedule", _E2E_BUCKETS
        )
        self.prompt_tokens = Counter("wsllm_prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter("wsllm_generation_tokens", "Generated tokens", m, registry=r)
        self.requests = Counter(
            "wsllm_requests", "Finished requests", ["model", "api", "finish_reason"], registry=r
        )
        self.aborts = Counter("wsllm_request_aborts", "Requests aborted", m, registry=r)
        self.errors = Counter(
            "wsllm_request_errors", "Requests failed or refused", ["model", "code"], registry=r
        )
        self.running = Gauge("wsllm_num_requests_running", "Requests the engines run", m, registry=r)
        self.waiting = Gauge(
            "wsllm_num_requests_waiting", "Requests waiting in the broker and the engines", m, registry=r
        )
        self.kv_usage = Gauge("wsllm_kv_cache_usage_ratio", "KV cache in use (0..1)", m, registry=r)
        # Engine-side figures, from the heartbeats (summed over engines).
        self.prefix_hit_rate = Gauge(
            "wsllm_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0..1)", m, registry=r
        )
        self.engine_preemptions = Gauge(
            "wsllm_engine_preemptions", "Sequences preempted since the engines started", m, registry=r
        )
        self.engine_aborts = Gauge(
            "wsllm_engine_aborted_requests", "Requests the engines aborted since they started", m, registry=r
        )
        # Speculative decoding (--speculative): the engines' counters since they started, by their
        # EngineStats field (mean accepted length = 1 + accepted / verifications)
        self.spec = {
            field: Gauge(f"wsllm_spec_{name}", text, m, registry=r) for field, name, text in SPEC_GAUGES
        }
        # Slow clients cut off, the event reader's restarts, what is buffered.
        self.send_timeouts = Counter(
            "wsllm_send_timeouts",
            "Clients disconnected because they took no data for --send-timeout-s",
            ["model", "transport"],
            registry=r,
        )
        self.reader_restarts = Gauge(
            "wsllm_event_reader_restarts", "Times the event reader failed and was restarted", m, registry=r
        )
        self.buffered_events = Gauge(
            "wsllm_buffered_events", "Events held for clients that have not read them yet", m, registry=r
        )
        # Per tenant (names from --api-keys-file; "anonymous" without one) and model,
        # in their own registry (operators only).
        self.tenant_registry = tr = CollectorRegistry()
        tm = ["tenant", "model"]
        self.tenant_requests = Counter(
            "wsllm_tenant_requests", "Requests admitted, by tenant and model", tm, registry=tr
        )
        self.tenant_tokens = Counter(
            "wsllm_tenant_tokens",
            "Tokens used (prompt + completion), by tenant and model",
            tm,
            registry=tr,
        )
        self.tenant_rate_limited = Counter(
            "wsllm_tenant_rate_limited", "Requests refused over a tenant's limits", tm, registry=tr
        )
        # the same figures for /v1/usage: tenant -> model -> TenantUsage
        self.usage: dict[str, dict[str, TenantUsage]] = {}
        self.views: dict[str, Metrics] = {}


@dataclass(slots=True)
class TenantUsage:
    """One tenant's figures for one model on this gateway since it started."""

    requests: int = 0  # admitted
    tokens: int = 0  # prompt + completion
    rate_limited: int = 0  # refused over its limits


class Metrics:
    """One model's metrics in a gateway's registry; `for_model` gives another model's,
    sharing the registry (one /metrics page for every model)."""

    def __init__(self, model_name: str, families: _Families | None = None) -> None:
        f = self.families = families or _Families()
        self.registry = f.registry
        self.model_name = model_name
        f.views.setdefault(model_name, self)
        self.ttft = f.ttft.labels(model_name)
        self.itl = f.itl.labels(model_name)
        self.e2e = f.e2e.labels(model_name)
        self.queue = f.queue.labels(model_name)
        self.prompt_tokens = f.prompt_tokens.labels(model_name)
        self.generation_tokens = f.generation_tokens.labels(model_name)
        self.aborts = f.aborts.labels(model_name)
        self.running = f.running.labels(model_name)
        self.waiting = f.waiting.labels(model_name)
        self.kv_usage = f.kv_usage.labels(model_name)
        self.prefix_hit_rate = f.prefix_hit_rate.labels(model_name)
        self.engine_preemptions = f.engine_preemptions.labels(model_name)
        self.engine_aborts = f.engine_aborts.labels(model_name)
        self.spec = {field: gauge.labels(model_name) for field, gauge in f.spec.items()}
        self.reader_restarts = f.reader_restarts.labels(model_name)
        self.buffered_events = f.buffered_events.labels(model_name)

    def for_model(self, name: str) -> Metrics:
        view = self.families.views.get(name)
        return view if view is not None else Metrics(name, self.families)

    def send_timeout(self, transport: str) -> None:
        self.families.send_timeouts.labels(self.model_name, transport).inc()

    def finished(self, api: str, finish_reason: str) -> None:
        self.families.requests.labels(self.model_name, api, finish_reason).inc()

    def error(self, code: str) -> None:
        self.families.errors.labels(self.model_name, code).inc()

    def _usage(self, tenant: str) -> TenantUsage:
        by_model = self.families.usage.setdefault(tenant, {})
        return by_model.setdefault(self.model_name, TenantUsage())

    def tenant_admitted(self, tenant: str, prompt_tokens: int) -> None:
        self.families.tenant_requests.labels(tenant, self.model_name).inc()
        self.families.tenant_tokens.labels(tenant, self.model_name).inc(prompt_tokens)
        u = self._usage(tenant)
        u.requests += 1
        u.tokens += prompt_tokens

    def tenant_completion(self, tenant: str, tokens: int) -> None:
        self.families.tenant_tokens.labels(tenant, self.model_name).inc(tokens)
        self._usage(tenant).tokens += tokens

    def tenant_limited(self, tenant: str) -> None:
        self.families.tenant_rate_limited.labels(tenant, self.model_name).inc()
        self._usage(tenant).rate_limited += 1

    def tenant_usage(self, tenant: str) -> dict[str, TenantUsage]:
        """`tenant`'s figures on this gateway, by model."""
        return dict(self.families.usage.get(tenant, {}))

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
        for field, gauge in self.spec.items():
            gauge.set(sum(s.get(field, 0) for s in stats))

    def render(self, models: Callable[[str], bool] | None = None, tenants: bool = False) -> bytes:
        """The Prometheus page: the samples of the models `models` accepts (None: every
        model's, for an operator), with the per-tenant families when `tenants` (an operator).
        A key learns nothing of the traffic of models it may not use."""
        page = generate_latest(self.registry if models is None else _Only(self.registry, models))  # type: ignore[arg-type]
        return page + generate_latest(self.families.tenant_registry) if tenants else page


class _Only:
    """A registry's families with only the samples of the models `keep` accepts (a
    sample with no model label is the gateway's own: kept)."""

    def __init__(self, registry: CollectorRegistry, keep: Callable[[str], bool]) -> None:
        self.registry, self.keep = registry, keep

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [
                s for s in family.samples if "model" not in s.labels or self.keep(s.labels["model"])
            ]
            yield kept
