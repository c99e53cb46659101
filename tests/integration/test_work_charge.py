"""Work a tenant makes the gateway or the engine do stays charged (issue 23): the
prompt-logprob rows and a spec's compile are kept when the request ends (the refund
gave them back, so the table came free once the request finished), and `/tokenize` and
`/detokenize` take their token counts from the tpm (they took only a request of the rpm).
Through the real app on the tiny model; the bucket's level is read from `/v1/usage`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

PROMPT = ([11, 250, 3000, 42, 7, 99, 1234, 5, 6, 8] * 6)[:60]
TPM = 300  # refills 5 tokens a second: the few tenths of a second a call takes move it little


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, anonymous_tpm=TPM) as s:
        yield s


@pytest.fixture(autouse=True)
def full_bucket(srv: Any) -> None:
    """Each test starts from a full tokens bucket (the last one's charges given back)."""
    from wsllm.broker.limits import Limits

    asyncio.run(srv.gateway.limiter.adjust("anonymous", Limits(tpm=TPM), -TPM))


def remaining(srv: Any) -> int:
    r = httpx.get(f"{srv.base_url}/v1/usage", timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["remaining"]["tokens"])


def taken_by(srv: Any, path: str, body: dict[str, Any]) -> int:
    """Tokens the call took from the bucket, once it ended (refill aside)."""
    before = remaining(srv)
    r = httpx.post(f"{srv.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return before - remaining(srv)


def test_prompt_logprob_rows_stay_charged_after_the_request_ends(srv: Any) -> None:
    plain = taken_by(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    table = taken_by(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0})
    assert 50 <= plain <= 61, plain  # its 60 prompt tokens and 1 generated
    assert 45 <= table - plain <= 75, (plain, table)  # the table's 60 rows, not refunded


def test_tokenize_and_detokenize_take_their_tokens_from_the_tpm(srv: Any) -> None:
    text = "the quick brown fox jumps over the lazy dog " * 8
    count = httpx.post(f"{srv.base_url}/tokenize", json={"prompt": text}, timeout=30).json()["count"]
    assert 60 <= count <= 120
    assert count - 15 <= taken_by(srv, "/tokenize", {"prompt": text}) <= count
    assert 45 <= taken_by(srv, "/detokenize", {"tokens": PROMPT}) <= 60


def test_a_spec_whose_compile_costs_more_than_the_tpm_is_refused_so(srv: Any) -> None:
    """At a price per compile-second no compile fits a 300-token bucket: the charge
    names the spec and the request is a 429 (a plain request still passes)."""
    old = srv.gateway.cfg.spec_compile_tokens_per_s
    srv.gateway.cfg.spec_compile_tokens_per_s = 10**9
    try:
        spec = {"regex": f"w{uuid.uuid4().hex[:8]}[a-z]{{2,5}}"}  # unique: compiled, not cached
        r = httpx.post(
            f"{srv.base_url}/v1/completions",
            json={"prompt": PROMPT[:5], "max_tokens": 4, "structured_outputs": spec},
            timeout=60,
        )
    finally:
        srv.gateway.cfg.spec_compile_tokens_per_s = old
    assert r.status_code == 429, r.text
    assert "structured-output spec" in r.json()["error"]["message"]
    ok = httpx.post(
        f"{srv.base_url}/v1/completions", json={"prompt": PROMPT[:5], "max_tokens": 4}, timeout=60
    )
    assert ok.status_code == 200, ok.text
