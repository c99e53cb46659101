"""The figures of one load level, with vLLM `bench serve`'s definitions, and the
table that sets levels side by side.

- TTFT: from sending a request to its first chunk with text.
- E2EL: from sending a request to its last chunk with choices.
- TPOT, per request with more than one output token: (E2EL - TTFT) / (output tokens - 1).
- ITL: every gap between successive chunks with text, pooled over all requests (a
  chunk that carries several tokens is one gap, as in vLLM).
- Output tokens: the server's `usage.completion_tokens` (stream_options.include_usage),
  else the number of chunks with text.
- Throughput: completed requests, output tokens and input + output tokens over the
  level's duration (first request sent to last request done)."""

from __future__ import annotations

from typing import Any

import numpy as np

from wsllm.loadgen.clients import Result

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
STATS = ("mean", "p50", "p90", "p99")


def stats_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """mean, std, min, p50, p90, p99, max in milliseconds (numpy's linear percentiles)."""
    if not values_s:
        return {"count": 0, **dict.fromkeys(("mean", "std", "min", "p50", "p90", "p99", "max"))}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": float(a.max()),
    }


def tpot(r: Result) -> float | None:
    return (r.e2el - r.ttft) / (r.output_tokens - 1) if r.ok and r.output_tokens > 1 else None


def summarize(
    results: list[Result],
    started: float,
    duration: float,
    concurrency: int | None,
    request_rate: float | None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "concurrency": concurrency,  # null: unbounded
        "request_rate": request_rate,  # null: all requests at once
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": stats_ms([r.e2el for r in ok]),
        "requests": [_request(r, started) for r in results],
    }


def _request(r: Result, started: float) -> dict[str, Any]:
    t = tpot(r)
    return {
        "ok": r.ok,
        "error": r.error or None,
        "sent_s": r.sent_at - started,
        "ttft_ms": r.ttft * 1000 if r.ok else None,
        "tpot_ms": t * 1000 if t is not None else None,
        "e2el_ms": r.e2el * 1000 if r.ok else None,
        "itl_ms": [g * 1000 for g in r.itl],
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "chunks": r.chunks,
    }


def level_name(run: dict[str, Any]) -> str:
    c = run["concurrency"]
    rate = run["request_rate"]
    name = f"c={c}" if c is not None else "c=∞"
    return f"{name}, {rate:g} req/s" if rate is not None else name


def table(runs: list[dict[str, Any]]) -> str:
    """A Markdown table: one column per level, one row per figure."""

    def num(x: float | None, fmt: str = ",.1f") -> str:
        return "–" if x is None else format(x, fmt)

    rows: list[tuple[str, list[str]]] = [
        ("requests ok / failed", [f"{r['completed']} / {r['failed']}" for r in runs]),
        ("duration (s)", [num(r["duration_s"], ".2f") for r in runs]),
        (
            "input / output tokens",
            [f"{r['total_input_tokens']:,} / {r['total_output_tokens']:,}" for r in runs],
        ),
        ("request/s", [num(r["request_throughput"], ".2f") for r in runs]),
        ("output tokens/s", [num(r["output_throughput"]) for r in runs]),
        ("total tokens/s", [num(r["total_token_throughput"]) for r in runs]),
    ]
    for m in METRICS:
        for s in STATS:
            rows.append((f"{NAMES[m]} {s} (ms)", [num(r[f"{m}_ms"][s]) for r in runs]))
    if any(r.get("speculation") for r in runs):  # the server's drafts during each level (its /metrics)
        rows.append(("drafted / accepted tokens", [_drafts(r.get("speculation")) for r in runs]))
        rows.append(
            (
                "mean accepted length",
                [num((r.get("speculation") or {}).get("mean_accepted_length"), ".2f") for r in runs],
            )
        )
    head = "| | " + " | ".join(level_name(r) for r in runs) + " |"
    sep = "| --- |" + " ---: |" * len(runs)
    body = ["| " + label + " | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join([head, sep, *body])


def _drafts(spec: dict[str, Any] | None) -> str:
    return "–" if not spec else f"{spec['drafted']:,} / {spec['accepted']:,}"
