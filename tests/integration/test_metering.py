"""Metering on a live gateway (memory broker, tiny model; that a 429 costs the gateway
no work, on every route, is test_admission_first.py): a charge larger than a tenant's whole tpm is a 429 that says so, beam search charged by
its width; /tokenize and /detokenize take from rpm; /metrics shows tenants' figures
only to an operator key, and a tenant reads its own through /v1/usage."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

KEYS = """
[tenants.frank]
keys = ["sk-frank"]
rpm = 1

[tenants.gina]
keys = ["sk-gina"]
tpm = 1000

[tenants.hal]
keys = ["sk-hal"]
rpm = 2

[tenants.jo]
keys = ["sk-jo"]
rpm = 100
tpm = 10000
max_concurrent = 3

[tenants.ops]
keys = ["sk-ops"]
roles = ["metrics"]
"""
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT = {
    "messages": [{"role": "user", "content": "Name a city. " * 40}],
    "max_tokens": 8,
    "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
}


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any, tmp_path_factory: Any) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with live_server(tiny_engine, api_keys_file=str(path), api_key="sk-admin") as s:
        yield s


def call(srv: Any, key: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if body is None:
        return httpx.get(f"{srv.base_url}{path}", headers=headers, timeout=60)
    return httpx.post(f"{srv.base_url}{path}", json=body, headers=headers, timeout=60)


def completion(srv: Any, key: str, **body: Any) -> httpx.Response:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0} | body
    return call(srv, key, "/v1/completions", body)


def test_a_charge_over_the_whole_tpm_is_a_429_that_says_so(srv: Any) -> None:
    wide = completion(srv, "sk-gina", n=8, max_tokens=200)  # 4 + 8 x 200 = 1604 of 1000
    err = wide.json()["error"]
    assert wide.status_code == 429 and err["code"] == "rate_limited"
    assert "1604 tokens" in err["message"] and "never pass" in err["message"]
    # Beam search generates beam_width sequences at once, whatever n it returns.
    beams = completion(srv, "sk-gina", use_beam_search=True, beam_width=8, max_tokens=150)
    assert beams.status_code == 429 and "1204 tokens" in beams.json()["error"]["message"]
    # A prompt of 4000 bytes is estimated at 1000 tokens, but it is not "never": its
    # exact charge is what counts (a run of "=" is 63 tokens).
    runs = completion(srv, "sk-gina", prompt="=" * 4000, max_tokens=4)
    assert runs.status_code == 200, runs.text
    time.sleep(runs.json()["usage"]["total_tokens"] * 60 / 1000 + 0.1)  # gina's bucket refills
    narrow = completion(srv, "sk-gina", use_beam_search=True, beam_width=2, max_tokens=4)
    assert narrow.status_code == 200, narrow.text
    assert int(narrow.headers["x-ratelimit-remaining-tokens"]) == 1000 - (4 + 2 * 4)


def test_tokenize_and_detokenize_take_from_rpm(srv: Any) -> None:
    first = call(srv, "sk-hal", "/tokenize", {"prompt": "hello there"})
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-requests"] == "2"
    assert call(srv, "sk-hal", "/detokenize", {"tokens": first.json()["tokens"]}).status_code == 200
    over = call(srv, "sk-hal", "/tokenize", {"prompt": "x " * 5000})
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limited"
    assert call(srv, "sk-hal", "/detokenize", {"tokens": [5, 6]}).status_code == 429
    usage = call(srv, "sk-hal", "/v1/usage").json()  # /v1/usage itself takes nothing
    assert usage["remaining"]["requests"] == 0
    assert usage["usage"] == {srv.gateway.model_name: {"requests": 0, "tokens": 0, "rate_limited": 2}}


def test_metrics_show_tenants_to_operators_only_and_usage_its_own(srv: Any) -> None:
    assert completion(srv, "sk-jo").status_code == 200
    for key in ("sk-jo", "sk-gina"):
        page = call(srv, key, "/metrics")
        assert page.status_code == 200 and "wsllm_prompt_tokens_total" in page.text
        assert "wsllm_tenant_" not in page.text and "frank" not in page.text
    ops = call(srv, "sk-ops", "/metrics").text
    assert 'wsllm_tenant_requests_total{model="' in ops and 'tenant="jo"' in ops
    model = srv.gateway.model_name
    deadline = time.monotonic() + 10  # completion tokens count when the request lets go
    while True:
        usage = call(srv, "sk-jo", "/v1/usage").json()
        if usage["usage"][model]["tokens"] == 8 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert usage["tenant"] == "jo" and usage["object"] == "usage"
    assert usage["limits"] == {"rpm": 100, "tpm": 10000, "max_concurrent": 3}
    assert usage["usage"] == {model: {"requests": 1, "tokens": 8, "rate_limited": 0}}
    assert usage["remaining"]["in_flight"] == 0 and 99 <= usage["remaining"]["requests"] <= 100
    assert usage["remaining"]["tokens"] <= 10000
    assert "frank" not in str(usage)
    assert call(srv, "sk-nobody", "/v1/usage").status_code == 401


def test_the_charge_of_a_text_prompt_is_set_right_after_tokenizing(srv: Any) -> None:
    """The coarse charge estimates a text prompt at 4 bytes a token; the headers (and
    the bucket) show the exact charge: the prompt's real tokens plus max_tokens."""
    prompt = "hello world " * 300  # 3600 bytes: an estimate of 900 tokens
    start = time.monotonic()
    r = completion(srv, "sk-jo", prompt=prompt, max_tokens=4, ignore_eos=True)
    refilled = (time.monotonic() - start) * 10000 / 60  # at most, while it was prepared
    assert r.status_code == 200, r.text
    charge = r.json()["usage"]["prompt_tokens"] + 4
    assert abs(charge - (900 + 4)) > refilled + 2, (charge, refilled)  # the estimate was not the truth
    left = int(r.headers["x-ratelimit-remaining-tokens"])
    assert 10000 - charge <= left <= 10000 - charge + refilled + 1
