"""vLLM's extensions through the official `openai` client (`extra_body`), streamed and whole
where they apply (issue 45): `return_token_ids` are the tokenizer's ids of the prompt and
the answer (SmolLM2, whose greedy text is plain words); on the tiny random model a chat's
`prompt_logprobs` equal the completions route's for the same rendered prompt,
`continue_final_message` continues the last assistant message and `echo` returns it,
`add_generation_prompt` and `chat_template_kwargs` reach the template (and only it, a
template that refuses them a 400 with its words), `continuous_usage_stats` puts the usage
so far in every chunk, `truncate_prompt_tokens` keeps the last N; `GET /version` and
`root` on the model cards; on the WebSocket the answer fields it has no place for are
refused by name."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import transformers
import websockets

import wsllm

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PREFILL = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
IDS = {"return_token_ids": True}


def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def tokenizer(srv: Any) -> Any:
    return transformers.AutoTokenizer.from_pretrained(srv.engine.model_dir)


@pytest.fixture(scope="module")
def smollm_server(live_server: Any, smollm_engine: Any) -> Iterator[Any]:
    with live_server(smollm_engine) as srv:
        yield srv


def test_return_token_ids_are_the_tokenizers_ids_of_prompt_and_answer(smollm_server: Any) -> None:
    c, tok = client(smollm_server), tokenizer(smollm_server)
    kw: dict[str, Any] = dict(
        model=smollm_server.gateway.model_name, max_tokens=5, temperature=0, extra_body=IDS
    )
    chat_prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = c.chat.completions.create(messages=CHAT, **kw)  # type: ignore[arg-type]
    answer = whole.choices[0].token_ids  # type: ignore[attr-defined]
    assert whole.prompt_token_ids == chat_prompt  # type: ignore[attr-defined]
    assert answer == tok.encode(whole.choices[0].message.content, add_special_tokens=False)
    assert len(answer) == whole.usage.completion_tokens == 5  # short of its end: no EOS among them
    chunks = list(c.chat.completions.create(messages=CHAT, stream=True, **kw))  # type: ignore[arg-type]
    assert chunks[0].prompt_token_ids == chat_prompt  # type: ignore[attr-defined]
    assert all(getattr(ch, "prompt_token_ids", None) is None for ch in chunks[1:])  # the first chunk only
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == answer  # type: ignore[attr-defined]
    prompt = "The three primary colors are"
    done = c.completions.create(prompt=prompt, **kw)
    choice = done.choices[0]
    assert choice.prompt_token_ids == tok.encode(prompt)  # type: ignore[attr-defined]
    assert choice.token_ids == tok.encode(choice.text, add_special_tokens=False)  # type: ignore[attr-defined]
    streamed = [ch.choices[0] for ch in c.completions.create(prompt=prompt, stream=True, **kw)]
    assert streamed[0].prompt_token_ids == tok.encode(prompt)  # type: ignore[attr-defined]
    assert [t for ch in streamed for t in ch.token_ids] == choice.token_ids  # type: ignore[attr-defined]
    plain = c.completions.create(prompt=prompt, model=kw["model"], max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_dump()  # only when asked


@pytest.fixture(scope="module")
def tiny(tiny_server: Any) -> openai.OpenAI:
    return client(tiny_server)


def _kw(srv: Any, **extra: Any) -> dict[str, Any]:
    body = {"ignore_eos": True} | extra.pop("extra_body", {})
    return dict(model=srv.gateway.model_name, max_tokens=6, temperature=0.0, extra_body=body) | extra


def test_chat_prompt_logprobs_equal_the_completions_for_the_same_prompt(
    tiny_server: Any, tiny: openai.OpenAI
) -> None:
    chat = tiny.chat.completions.create(
        messages=CHAT, **_kw(tiny_server, extra_body=IDS | {"prompt_logprobs": 2})
    )
    table = chat.prompt_logprobs  # type: ignore[attr-defined]
    ids = chat.prompt_token_ids  # type: ignore[attr-defined]
    done = tiny.completions.create(prompt=ids, **_kw(tiny_server, extra_body={"prompt_logprobs": 2}))
    same = done.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert len(table) == len(ids) == len(same) and table[0] is None is same[0]
    for got, want in zip(table[1:], same[1:], strict=True):
        assert got.keys() == want.keys() and len(got) in (2, 3)
        for tid, e in got.items():
            assert e["logprob"] == pytest.approx(want[tid]["logprob"], abs=1e-5)
            assert (e.get("rank"), e["decoded_token"]) == (want[tid].get("rank"), want[tid]["decoded_token"])
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's rule: a chat's are not streamed
        tiny.chat.completions.create(
            messages=CHAT, stream=True, **_kw(tiny_server, extra_body={"prompt_logprobs": 1})
        )
    assert e.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_continue_final_message_continues_the_assistant_message_and_echo_returns_it(
    tiny_server: Any, tiny: openai.OpenAI
) -> None:
    tok, last = tokenizer(tiny_server), PREFILL[-1]["content"]
    prefill = IDS | {"continue_final_message": True, "add_generation_prompt": False}
    r = tiny.chat.completions.create(messages=PREFILL, **_kw(tiny_server, extra_body=prefill))  # type: ignore[arg-type]
    rendered = tok.apply_chat_template(PREFILL, continue_final_message=True, tokenize=False)
    assert r.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)  # type: ignore[attr-defined]
    assert tok.decode(r.prompt_token_ids).endswith(last)  # type: ignore[attr-defined]  # left open
    echoed = tiny.chat.completions.create(
        messages=PREFILL,
        **_kw(tiny_server, extra_body=prefill | {"echo": True}),  # type: ignore[arg-type]
    )
    content = echoed.choices[0].message.content or ""
    assert content == last + (r.choices[0].message.content or "")
    whole = tok.apply_chat_template([*CHAT, {"role": "assistant", "content": content}], tokenize=False)
    assert whole.startswith(rendered)  # the answer is the message, continued
    stream = tiny.chat.completions.create(
        messages=PREFILL,
        stream=True,
        **_kw(tiny_server, extra_body=prefill | {"echo": True}),  # type: ignore[arg-type]
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == content
    bare = tiny.chat.completions.create(
        messages=CHAT,
        **_kw(tiny_server, extra_body=IDS | {"add_generation_prompt": False}),  # type: ignore[arg-type]
    )
    assert bare.prompt_token_ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as e:  # with add_generation_prompt left true: vLLM's 400
        tiny.chat.completions.create(
            messages=PREFILL,
            **_kw(tiny_server, extra_body={"continue_final_message": True}),  # type: ignore[arg-type]
        )
    assert e.value.body["param"] == "continue_final_message"  # type: ignore[index]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    "options", [{"include_usage": True, "continuous_usage_stats": True}, {"continuous_usage_stats": True}]
)
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(
    tiny_server: Any, tiny: openai.OpenAI, n: int, options: dict[str, bool]
) -> None:
    for chat in (True, False):
        kw = _kw(tiny_server, n=n, stream=True, stream_options=options, extra_body=IDS)
        stream = (
            tiny.chat.completions.create(messages=CHAT, **kw)  # type: ignore[arg-type]
            if chat
            else tiny.completions.create(prompt="w1 w2 w3", **kw)
        )
        *chunks, last = list(stream)
        assert last.choices == [] and last.usage.completion_tokens == 6 * n
        sent = 0
        for ch in chunks:
            sent += len(ch.choices[0].token_ids)  # type: ignore[attr-defined]
            assert ch.usage is not None and ch.usage.prompt_tokens == last.usage.prompt_tokens
            assert (
                ch.usage.completion_tokens == sent and ch.usage.total_tokens == ch.usage.prompt_tokens + sent
            )
        assert sent == 6 * n


def test_truncate_prompt_tokens_keeps_the_last_n(tiny_server: Any, tiny: openai.OpenAI) -> None:
    tok = tokenizer(tiny_server)
    text = " ".join(f"w{i}" for i in range(40))
    ids = tok.encode(text)
    for stream in (False, True):
        got = tiny.completions.create(
            prompt=text, stream=stream, **_kw(tiny_server, extra_body=IDS | {"truncate_prompt_tokens": 5})
        )
        first = next(iter(got)).choices[0] if stream else got.choices[0]  # type: ignore[arg-type]
        assert first.prompt_token_ids == ids[-5:]  # type: ignore[attr-defined]
    echo = tiny.completions.create(
        prompt=text, echo=True, **_kw(tiny_server, extra_body={"truncate_prompt_tokens": 5})
    )
    assert echo.usage.prompt_tokens == 5 and echo.choices[0].text.startswith(tok.decode(ids[-5:]))
    messages = [{"role": "user", "content": text}]
    chat = tiny.chat.completions.create(
        messages=messages, **_kw(tiny_server, extra_body=IDS | {"truncate_prompt_tokens": 12})
    )  # type: ignore[arg-type]
    whole = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.prompt_token_ids == whole[-12:] and chat.usage.prompt_tokens == 12  # type: ignore[attr-defined]
    every = tiny.completions.create(
        prompt=text, **_kw(tiny_server, extra_body={"truncate_prompt_tokens": -1})
    )
    assert every.usage.prompt_tokens == len(ids)  # -1: as much as the context holds
    context = tiny_server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        tiny.completions.create(
            prompt=text, **_kw(tiny_server, extra_body={"truncate_prompt_tokens": context + 1})
        )
    assert e.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_version_and_the_model_cards_root(tiny_server: Any, tiny: openai.OpenAI) -> None:
    assert httpx.get(f"{tiny_server.base_url}/version").json() == {"version": wsllm.__version__}
    name = tiny_server.gateway.model_name
    assert tiny.models.retrieve(name).root == name  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"return_token_ids": True}, "return_token_ids"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ],
)
def test_the_websocket_refuses_the_http_answers_fields_by_name(
    tiny_server: Any, extra: dict[str, Any], param: str
) -> None:
    msg = {"type": "chat", "id": "x", "messages": CHAT, "max_tokens": 1} | extra

    async def go() -> dict[str, Any]:
        async with websockets.connect(tiny_server.ws_url) as ws:
            await ws.recv()  # hello
            await ws.send(orjson.dumps(msg).decode())
            return dict(orjson.loads(await ws.recv()))

    err = asyncio.run(go())
    assert err["type"] == "error" and err["param"] == param


# -- a template of the test's own: chat_template_kwargs reach it, and only it ----------------

TEMPLATE = (
    "{%- if strict is defined and strict %}{{ raise_exception('strict mode refuses these messages') }}{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif -%}"
)


@pytest.fixture(scope="module")
def templated(
    live_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    model_dir = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    engine = LLMEngine.from_config(
        EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_seqs=4, dtype="float32")
    )
    with live_server(engine) as srv:
        yield srv


def test_chat_template_kwargs_reach_the_template_and_only_it(templated: Any) -> None:
    c = client(templated)

    def chat(kwargs: dict[str, Any]) -> Any:
        body = IDS | {"chat_template_kwargs": kwargs}
        return c.chat.completions.create(messages=CHAT, **_kw(templated, extra_body=body))  # type: ignore[arg-type]

    plain, off = chat({}), chat({"enable_thinking": False})
    think = templated.gateway.codec.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert off.prompt_token_ids == plain.prompt_token_ids + think  # type: ignore[attr-defined]
    # named like sampling fields, they are the template's variables, never the request's
    odd = chat({"max_tokens": 1, "n": 3, "temperature": 2.0})
    assert len(odd.choices) == 1 and odd.usage.completion_tokens == 6
    assert odd.choices[0].message.content == plain.choices[0].message.content  # still greedy
    with pytest.raises(openai.BadRequestError) as e:
        chat({"strict": True})
    assert "strict mode refuses these messages" in e.value.message
