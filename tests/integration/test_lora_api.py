"""LoRA adapters through the gateway (memory broker, tiny random model): `/v1/models` lists
each adapter with its `parent`, a key of the keys file may be allowed an adapter alone, a
request names an adapter as its `model` (the answer says it back) and an unknown one is a
404 in OpenAI's shape; the operator loads and unloads adapters at run time while other
requests stream, and nothing is lost: the streams end whole, a request under an adapter
being unloaded finishes on it, and no KV block is left behind (the server's teardown)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

OPERATOR = "sk-operator"
KEYS = """
[tenants.cust]
keys = ["sk-cust"]
models = ["a0"]

[tenants.user]
keys = ["sk-user"]
"""


@pytest.fixture(scope="module")
def adapter_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, lora_factory: Any
) -> list[Path]:
    root = tmp_path_factory.mktemp("lora-api")
    return [lora_factory(root / f"a{i}", tiny_model_dir, 100 + i, r=4, alpha=8) for i in range(2)]


@pytest.fixture(scope="module")
def srv(
    live_server: Any, tiny_model_dir: Path, adapter_dirs: list[Path], tmp_path_factory: Any
) -> Iterator[Any]:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), num_kv_blocks=512, max_num_seqs=16, dtype="float32",
            lora=[f"a0={adapter_dirs[0]}"], max_loras=2,
            allow_adapter_dir=str(tmp_path_factory.getbasetemp()),  # its adapters and tiny_model_dir
        )
    )  # fmt: skip
    keys = tmp_path_factory.mktemp("lora-keys") / "keys.toml"
    keys.write_text(KEYS)
    with live_server(engine, api_key=OPERATOR, api_keys_file=str(keys)) as s:
        yield s


def client(srv: Any, key: str = OPERATOR) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0)


def post(srv: Any, path: str, body: dict[str, Any], key: str = OPERATOR) -> httpx.Response:
    return httpx.post(
        f"{srv.base_url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def complete(srv: Any, model: str, max_tokens: int = 8, prompt: str = "w1 w2 w3 w4") -> Any:
    return client(srv).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def test_models_lists_each_adapter_with_its_parent_and_a_key_may_have_an_adapter_alone(srv: Any) -> None:
    base = srv.engine.model_name
    cards = {m.id: m for m in client(srv).models.list().data}
    assert cards["a0"].parent == base and cards["a0"].lora is True  # type: ignore[attr-defined]
    assert [m.id for m in client(srv, "sk-cust").models.list().data] == ["a0"]
    assert complete_as(srv, "sk-cust", "a0").model == "a0"
    with pytest.raises(openai.NotFoundError) as e:
        complete_as(srv, "sk-cust", base)
    assert e.value.code == "model_not_found"


def complete_as(srv: Any, key: str, model: str) -> Any:
    return client(srv, key).completions.create(model=model, prompt="w1", max_tokens=2, temperature=0.0)


def test_a_request_runs_under_its_adapter_and_an_unknown_one_is_a_404(srv: Any) -> None:
    base, lora = complete(srv, srv.engine.model_name), complete(srv, "a0")
    assert lora.model == "a0" and base.model == srv.engine.model_name
    assert lora.choices[0].text != base.choices[0].text  # the adapter moves the answer
    chat = client(srv).chat.completions.create(
        model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert {chunk.model for chunk in chat} == {"a0"}
    with pytest.raises(openai.NotFoundError) as e:
        complete(srv, "no-such-adapter")
    assert e.value.code == "model_not_found" and e.value.status_code == 404


def test_bad_loads_are_refused_with_the_reason_and_the_operator_alone_may_load(
    srv: Any, tiny_model_dir: Path, adapter_dirs: list[Path]
) -> None:
    got = post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tiny_model_dir / "nothing")})
    assert got.status_code == 404 and "no adapter directory" in got.json()["error"]["message"]  # vLLM's 404
    got = post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tiny_model_dir)})
    assert got.status_code == 400 and "adapter_config.json" in got.json()["error"]["message"]  # no adapter
    got = post(srv, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": str(adapter_dirs[0])})
    assert got.status_code == 400 and "already loaded" in got.json()["error"]["message"]
    got = post(
        srv, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapter_dirs[1])}, key="sk-user"
    )
    assert got.status_code == 403 and got.json()["error"]["code"] == "permission_denied"
    got = post(srv, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert got.status_code == 404 and got.json()["error"]["code"] == "model_not_found"
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "bad name"}).status_code == 400


def test_load_and_unload_while_other_requests_stream_lose_nothing(srv: Any, adapter_dirs: list[Path]) -> None:
    results: dict[str, Any] = {}

    def stream(name: str, model: str) -> None:
        chunks = list(
            client(srv).completions.create(
                model=model, prompt="w5 w6", max_tokens=48, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        results[name] = ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1])

    alone = complete(srv, "a0", 48, "w5 w6").choices[0].text
    threads = [
        threading.Thread(target=stream, args=(n, m))
        for n, m in (("base", srv.engine.model_name), ("a0", "a0"))
    ]
    for t in threads:
        t.start()
    srv.worker.wait_steps(2)  # both stream now
    got = post(srv, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapter_dirs[1])})
    assert got.status_code == 200 and got.json()["engines"] == 1
    assert complete(srv, "a1").model == "a1"
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a0"}).status_code == 200
    for t in threads:
        t.join(60)
    assert results["a0"][0] == alone  # it finished on the adapter it started with, whole
    assert len(results["base"][0]) > 0 and results["base"][1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        complete(srv, "a0")
    assert "a0" not in {m.id for m in client(srv).models.list().data}
    assert (
        post(srv, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": str(adapter_dirs[0])}).status_code
        == 200
    )
    assert complete(srv, "a0", 48, "w5 w6").choices[0].text == alone  # the same weights: the same answer


def test_any_number_of_adapters_register_and_the_others_load_on_demand(
    srv: Any, tiny_model_dir: Path, adapter_dirs: list[Path]
) -> None:
    """vLLM's `--max-loras`: any number of adapters register; at most `--max-loras` (2 here)
    are resident, the others load when a request needs them, and every adapter answers with
    its own weights whichever were resident before."""
    names = {"r0": adapter_dirs[0], "r1": adapter_dirs[1], "r2": adapter_dirs[0], "r3": adapter_dirs[1]}
    try:
        for name, path in names.items():
            got = post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            assert got.status_code == 200, got.text
        got = post(srv, "/v1/load_lora_adapter", {"lora_name": "r4", "lora_path": str(tiny_model_dir / "no")})
        assert got.status_code == 404  # the path is checked, not a cap on how many are registered
        assert set(names) <= {m.id for m in client(srv).models.list().data}
        first = {n: complete(srv, n).choices[0].text for n in names}
        assert first["r0"] == first["r2"] != first["r1"] == first["r3"]  # each its own weights
        for name in ["r1", "r0", "r3", "r2", "r0"]:  # each request evicts the least recent
            assert complete(srv, name).choices[0].text == first[name]
            assert len(srv.engine.adapters.resident()) <= 2
    finally:
        for name in names:
            post(srv, "/v1/unload_lora_adapter", {"lora_name": name})
