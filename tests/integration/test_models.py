"""One gateway, several models (issue 14): two random-weight tiny models with different
vocabularies (SmolLM2's 49152 tokens; 512 words `w0`..`w508`) behind two gateways on
one Redis, and in one `wsllm serve --model A --model B` process. Every gateway lists
both, answers each from the right model, and goes on serving one when the other's
engine is killed."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_fixtures import (
    ROOT,
    Cluster,
    free_port,
    on_one_and_on_a_cluster,  # noqa: F401 - every test runs on both
)

WORDS = re.compile(r"^( ?w\d+)*$")  # all the text the word model can write
A, B = "tiny-llama", "tiny-words"


def complete(base: str, model: str, prompt: Any, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body | kw, timeout=60)


def check_both_served(base: str) -> tuple[str, str]:
    """Both models listed with their context length; each answers from its own
    vocabulary; a model nobody serves is a 404 naming the served ones."""
    cards = {m["id"]: m for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}
    assert set(cards) == {A, B} and all(c["max_model_len"] == 2048 for c in cards.values()), cards
    a, b = complete(base, A, [5, 6, 7]), complete(base, B, [5, 6, 7])
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert (a.json()["model"], b.json()["model"]) == (A, B)
    text_a, text_b = a.json()["choices"][0]["text"], b.json()["choices"][0]["text"]
    assert WORDS.match(text_b) and text_b.strip(), text_b  # the word model wrote it
    assert not WORDS.match(text_a), text_a  # SmolLM2's tokens are not those words
    # the gateway checks a prompt against the model's own vocabulary
    big = complete(base, B, [5000])
    assert big.status_code == 400 and "vocabulary (size 512)" in big.json()["error"]["message"], big.text
    assert complete(base, A, [5000]).status_code == 200
    missing = complete(base, "nope", [5])
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert A in missing.json()["error"]["message"] and B in missing.json()["error"]["message"]
    return text_a, text_b


@pytest.fixture(scope="module")
def two_models(
    redis_server: Any,
    tiny_model_dir: Path,
    tiny_words_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """Engines of A and B; gateway 1 has A's tokenizer on disk, gateway 2 B's: each
    finds the other model's in what its engine published to Redis."""
    redis_server.client().flushall()
    a_dir = tmp_path_factory.mktemp("models") / A
    b_dir = a_dir.parent / B
    a_dir.symlink_to(tiny_model_dir)  # the served name is the directory's
    b_dir.symlink_to(tiny_words_model_dir)
    c = Cluster(redis_server.url, a_dir, tmp_path_factory.mktemp("models-logs"))
    try:
        c.start_engine("engine-a")
        c.start_engine("engine-b", model_dir=b_dir)
        c.start_gateway()
        c.start_gateway(model_dir=b_dir)
        c.wait_ready(engines=2)
        yield c
    finally:
        c.stop()


def test_two_gateways_serve_both_models_and_one_survives_the_others_kill_9(two_models: Cluster) -> None:
    one, two = two_models.urls
    assert check_both_served(one) == check_both_served(two)  # greedy: the same model, the same text
    two_models.engines["engine-b"].signal(signal.SIGKILL)
    deadline = time.monotonic() + 15  # the dead engine's registration expires (--engine-ttl-s 2)
    while {m["id"] for m in httpx.get(f"{one}/v1/models").json()["data"]} != {A}:
        assert time.monotonic() < deadline, "the killed engine's model is still listed"
        time.sleep(0.2)
    for base in (one, two):
        gone = complete(base, B, [5, 6])
        assert gone.status_code in (404, 503), gone.text  # no engine of B: refused, not queued
        assert complete(base, A, [5, 6]).status_code == 200
    assert all(g.alive() for g in two_models.gateways.values())


def test_wsllm_serve_runs_one_engine_per_model_in_one_process(
    tiny_model_dir: Path, tiny_words_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / A).symlink_to(tiny_model_dir)
    (tmp_path / B).symlink_to(tiny_words_model_dir)
    port = free_port()
    cmd = [sys.executable, "-m", "wsllm", "serve", "--log-level", "warning", "--model", str(tmp_path / A),
           "--model", str(tmp_path / B), "--port", str(port), "--num-kv-blocks", "64", "--threads", "1",
           "--no-frontend"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"serving {A}, {B} at http://127.0.0.1:{port}/" in line, line
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "wsllm serve never got ready"
            time.sleep(0.2)
        check_both_served(base)
        # a request that names no model goes to the first --model
        plain = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert plain.status_code == 200 and plain.json()["model"] == A, plain.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
