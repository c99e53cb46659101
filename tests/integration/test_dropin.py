"""The defects a peer's server tests found, each through the official `openai` client
against the real app on the tiny random model (issue 45): `models.retrieve` answers a
card or a 404 that says the model does not exist; a stream of several choices (n > 1, a
list of prompts) sends one choice a chunk, named by its `index`; completion logprobs list
the sampled token beside the top N; `/tokenize` takes `add_special_tokens` with
`messages`; `stream_options` without `stream` is a 400. (Anthropic's usage is
test_messages_api.py's, the adapter routes' answers test_lora_api.py's.)"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import transformers

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_server: Any) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_server.engine.model_dir)


def test_models_retrieve_answers_the_card_or_a_404_that_says_the_model_does_not_exist(
    tiny_server: Any, tiny_openai: openai.OpenAI
) -> None:
    name = tiny_server.gateway.model_name
    card = tiny_openai.models.retrieve(name)
    assert card.id == name and card.object == "model"
    assert card.model_dump() == next(m.model_dump() for m in tiny_openai.models.list().data if m.id == name)
    with pytest.raises(openai.NotFoundError) as e:
        tiny_openai.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and "does not exist" in e.value.message


def _one_choice_a_chunk(chunks: list[Any]) -> dict[int, tuple[str, str | None]]:
    """Each choice's text and finish reason, read as the usual client code reads a
    stream (`chunk.choices[0]`), after checking that no chunk carries two choices."""
    assert all(len(ch.choices) <= 1 for ch in chunks), [len(ch.choices) for ch in chunks]
    out: dict[int, tuple[str, str | None]] = {}
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        piece = c.delta.content or "" if hasattr(c, "delta") else c.text
        text, finish = out.get(c.index, ("", None))
        out[c.index] = (text + piece, c.finish_reason or finish)
    return out


def test_a_stream_of_several_choices_sends_one_choice_a_chunk(
    tiny_server: Any, tiny_openai: openai.OpenAI
) -> None:
    model = tiny_server.gateway.model_name
    common: dict[str, Any] = dict(model=model, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    chat = list(tiny_openai.chat.completions.create(messages=CHAT, n=2, stream=True, **common))
    whole = tiny_openai.chat.completions.create(messages=CHAT, n=2, **common)
    got = _one_choice_a_chunk(chat)
    assert got == {c.index: (c.message.content, "length") for c in whole.choices}
    prompts = ["w1 w2", "w3"]
    batch = list(tiny_openai.completions.create(prompt=prompts, n=2, stream=True, **common))
    whole_batch = tiny_openai.completions.create(prompt=prompts, n=2, **common)
    got = _one_choice_a_chunk(batch)
    assert got == {c.index: (c.text, "length") for c in whole_batch.choices} and sorted(got) == [0, 1, 2, 3]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [0, 2])
def test_completion_logprobs_always_list_the_sampled_token(
    tiny_server: Any, tiny_openai: openai.OpenAI, n: int, stream: bool
) -> None:
    """OpenAI's legacy completions: `top_logprobs` holds the top N and the sampled token
    (N + 1 entries when it is not among them); `logprobs: 0` gives the sampled token alone."""
    r = tiny_openai.completions.create(
        model=tiny_server.gateway.model_name, prompt="w1 w2 w3", max_tokens=6, temperature=1.0, seed=7,
        logprobs=n, stream=stream, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lps = [ch.choices[0].logprobs for ch in r if ch.choices] if stream else [r.choices[0].logprobs]
    tokens = [t for lp in lps for t in lp.tokens]
    sampled = [x for lp in lps for x in lp.token_logprobs]
    tops = [x for lp in lps for x in lp.top_logprobs]
    assert len(tokens) == len(tops) == 6
    for token, lp, top in zip(tokens, sampled, tops, strict=True):
        assert top[token] == pytest.approx(lp)
        assert n <= len(top) <= n + 1 if n else top == {token: lp}


def test_tokenize_takes_add_special_tokens_with_messages(tiny_server: Any, tokenizer: Any) -> None:
    """vLLM's: the special tokens of the tokenizer on top of what the template writes."""
    tok = tokenizer
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for special in (True, False):
        r = httpx.post(
            f"{tiny_server.base_url}/tokenize",
            json={"messages": CHAT, "add_special_tokens": special},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(rendered, add_special_tokens=special)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "w1"})],
)
def test_stream_options_without_stream_is_a_400(tiny_server: Any, path: str, body: dict[str, Any]) -> None:
    for stream in ({}, {"stream": False}):
        r = httpx.post(
            f"{tiny_server.base_url}{path}",
            json=body | stream | {"max_tokens": 1, "stream_options": {"include_usage": True}},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "stream_options"
