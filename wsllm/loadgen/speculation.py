"""What speculative decoding did during a level, read from the server's /metrics before and
after it: draft tokens verified, accepted, and the mean accepted length (tokens a
verification keeps, the bonus token included). A server without these metrics (another
server, wsllm without --speculative) reports nothing."""

from __future__ import annotations

import re
from typing import Any

import httpx

from wsllm.loadgen.clients import root_url

# How long after a level its counters are read: the gateway's gauges follow the engines'
# heartbeats (every 0.5 s in one process, wsllm/engine/worker.py)
SETTLE_S = 1.0
# The engine's counters as the gateway exports them (wsllm/server/metrics.py).
_NAMES = {
    "wsllm_spec_draft_tokens": "drafted",
    "wsllm_spec_accepted_tokens": "accepted",
    "wsllm_spec_verifications": "verifications",
}
_LINE = re.compile(r"^(wsllm_spec_\w+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


async def counters(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """The speculation counters now, summed over the server's engines; {} when it has none."""
    try:
        async with httpx.AsyncClient(headers=headers, timeout=10) as http:
            r = await http.get(root_url(base_url) + "/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for name, value in _LINE.findall(r.text):
        if name in _NAMES:
            key = _NAMES[name]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """The level's share of the counters; None when the server speculated not at all."""
    if not after:
        return None
    d = {k: int(after.get(k, 0.0) - before.get(k, 0.0)) for k in _NAMES.values()}
    if not d["verifications"]:
        return None
    return d | {"mean_accepted_length": 1 + d["accepted"] / d["verifications"]}
