"""/v1/embeddings shares the tenants' limits with the generate routes: its inputs'
tokens count against the key's tpm (so a chat after them is refused, and they are
refused after a chat), with OpenAI's 429 and x-ratelimit-* headers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

KEYS = """
[tenants.tight]
keys = ["sk-tight"]
tpm = 100

[tenants.roomy]
keys = ["sk-roomy"]
"""


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any, tmp_path_factory: Any) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with live_server(tiny_engine, api_keys_file=str(path), api_key="sk-admin") as s:
        yield s


def post(srv: Any, key: str, route: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{srv.base_url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_embeddings_and_completions_draw_on_one_tpm(srv: Any) -> None:
    ids = list(range(10, 40))  # 30 tokens
    r = post(srv, "sk-tight", "embeddings", {"input": [ids, ids]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 60
    assert r.headers["x-ratelimit-limit-tokens"] == "100"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 40
    # 60 of 100 used: a completion charged 4 + 50 tokens does not fit, for this key only
    completion = {"prompt": [5, 6, 7, 8], "max_tokens": 50}
    refused = post(srv, "sk-tight", "completions", completion)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    assert refused.headers["retry-after"]
    assert post(srv, "sk-roomy", "completions", completion).status_code == 200
    # and embeddings past what is left are refused the same way, before any engine work
    steps = srv.worker.steps
    over = post(srv, "sk-tight", "embeddings", {"input": ids + ids})
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limited"
    assert set(over.json()["error"]) == {"message", "type", "param", "code"}
    assert srv.worker.steps == steps
    assert srv.metric("wsllm_tenant_tokens_total", tenant="tight") >= 60
    srv.assert_no_blocks_held()
