"""vLLM's /tokenize and /detokenize, through the real app on the tiny random model:
/tokenize counts a prompt or a chat's messages as the generate routes count them (the
chat through the same template), /detokenize inverts it, and both check the vocabulary,
the model and their fields."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import transformers


def post(srv: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, timeout=60)


def test_tokenize_counts_what_the_generate_routes_count(tiny_server: Any, tiny_openai: openai.OpenAI) -> None:
    text = "Tokens, counted before sending: 12345!"
    tok = post(tiny_server, "/tokenize", {"model": tiny_server.gateway.model_name, "prompt": text}).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}  # vLLM's TokenizeResponse
    assert tok["token_strs"] is None and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == tiny_server.engine.max_model_len
    done = tiny_openai.completions.create(model=tiny_server.gateway.model_name, prompt=text, max_tokens=1)
    assert done.usage is not None and tok["count"] == done.usage.prompt_tokens
    # a chat's messages go through the template exactly as a chat request's do
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat_tok = post(tiny_server, "/tokenize", {"messages": messages}).json()
    chat = tiny_openai.chat.completions.create(
        model=tiny_server.gateway.model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert chat.usage is not None and chat_tok["count"] == chat.usage.prompt_tokens
    bare = post(tiny_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert chat_tok["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat_tok["count"]
    strs = post(tiny_server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    hf = transformers.AutoTokenizer.from_pretrained(tiny_server.engine.model_dir)
    assert strs == hf.convert_ids_to_tokens(tok["tokens"])  # vLLM's token_strs


def test_detokenize_inverts_tokenize_and_checks_the_vocabulary(tiny_server: Any) -> None:
    text = "Round trip: héllo wörld"
    ids = post(tiny_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    back = post(tiny_server, "/detokenize", {"model": tiny_server.gateway.model_name, "tokens": ids})
    assert back.json() == {"prompt": text}  # vLLM's DetokenizeResponse
    vocab = tiny_server.gateway.codec.vocab_size
    bad = post(tiny_server, "/detokenize", {"tokens": [1, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    missing = post(tiny_server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    typo = post(tiny_server, "/tokenize", {"prompt": "x", "add_special_token": True})
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "add_special_token"
