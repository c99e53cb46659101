"""/v1/embeddings on Redis: the request and its vector cross Redis Streams (the wire's
`pooling` and `embedding`), through gateway A in this process and gateway B a child
process, with the same vectors from both and nothing left in the engine."""

from __future__ import annotations

import math
from typing import Any

import openai

TEXTS = ["The cat sat on the mat.", "héllo wörld ✓"]


def test_both_gateways_give_the_same_vectors(redis_deployment: Any) -> None:
    d = redis_deployment
    got = []
    for base in (d.a, d.b):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = client.embeddings.create(model=d.model, input=TEXTS)  # base64, decoded by the client
        assert [len(x.embedding) for x in r.data] == [64, 64]
        assert all(abs(math.hypot(*x.embedding) - 1.0) < 1e-5 for x in r.data)
        got.append([x.embedding for x in r.data])
    assert got[0] == got[1]
    d.engine_idle()
