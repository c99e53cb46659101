"""Preparation: a checked, admitted request and the model it goes to become what the
engine and the gateway's text work need (`Prepared`): the prompt's token ids, the
engine's SamplingParams, how the answer is read (the chat output plan) and the
request's ResumeContext. A chat or completion request (`prepare`) and each input of an
embeddings call (`embeddings`); `/tokenize` and `/detokenize` use the same steps.

It runs only after admission (gateway.py), and it is the one stage that needs the
model's tokenizer (or compiles), so the 400s that need them come from here and nowhere
else; every other 400 of a request is its validation's (schemas.py, the wings' request
modules). They are:
- a text whose characters alone are more than the context can hold (before it is
  tokenized: no token is longer than the vocabulary's longest string);
- a prompt (with `max_tokens`) longer than the context, an empty embeddings input, a
  `truncate_prompt_tokens` past the context;
- token ids outside the vocabulary (prompt, stop_token_ids, logit_bias keys);
- the chat template's refusal, or its deadline;
- a tool call or response format whose grammar does not compile, or not in time;
- a `suffix` for a model without fill-in-the-middle tokens;
- a prompt-logprobs table over --max-prompt-logprobs entries.
- an image for a model that cannot see (the first image part named)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from wsllm.config_gateway import GatewayConfig
from wsllm.prefix_hash import ImageSpan
from wsllm.server import image_prompt, programs, textwork
from wsllm.server.chat.output import OutputOptions
from wsllm.server.chat.plan import plan_chat, wanted_constraint
from wsllm.server.errors import APIError
from wsllm.server.fim import fim_prompt
from wsllm.server.images import Image
from wsllm.server.models import ServedModel
from wsllm.server.resume import Api, ResumeContext
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.text import TemplateError, TextCodec
from wsllm.types import GREEDY_BELOW, SamplingParams

# Prompts longer than this (characters, counting each message's overhead) are
# tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 4096
T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class Prepared:
    """A request ready to submit."""

    prompt_ids: list[int]
    params: SamplingParams
    #: what a gateway needs to read its answer, here or after a resume
    context: ResumeContext
    #: seconds the gateway spent checking its structured-output spec (0: none), for the charge
    compile_s: float = 0.0
    #: the request's own `cache_salt` (vLLM's; "": none), narrowing its tenant's prefix cache
    cache_salt: str = ""
    #: its images with their placeholders' spans in `prompt_ids` (a model that sees)
    images: list[tuple[Image, ImageSpan]] = field(default_factory=list)

    @property
    def prompt_logprobs_entries(self) -> int:
        """Entries of the prompt-logprobs table this request asks for (0: none): work the
        engine computes and the gateway renders, for the tenant's charge."""
        return prompt_logprobs_entries(self.params, len(self.prompt_ids))


def prompt_logprobs_entries(params: SamplingParams, prompt_len: int) -> int:
    """Prompt tokens x (top N + 1): the size of a request's prompt-logprobs table."""
    k = params.prompt_logprobs
    return 0 if k is None else prompt_len * (k + 1)


async def prepare(
    req: ChatRequest | CompletionRequest,
    api: Api,
    model: ServedModel,
    max_len: int,
    cfg: GatewayConfig,
    tenant: str = "",
) -> Prepared:
    """`req` (checked against its schema and the operator's limits) for `model`, whose
    live engines allow `max_len` tokens of context. Raises APIError (400). `tenant`: whose
    turn its template and spec check take on the programs' pools (programs.py)."""
    codec = model.codec
    check_sight(req, model)
    _check_vocab(codec, req)
    if req.truncate_prompt_tokens is None:  # a truncated prompt may be longer than the context
        _fits(codec, _prompt_chars(req), max_len, "messages" if isinstance(req, ChatRequest) else "prompt")
    plan = plan_chat(req, codec, model.name, cfg.tool_parser) if isinstance(req, ChatRequest) else None
    wanted = wanted_constraint(req, plan)
    structured, compile_s = (
        (None, 0.0) if wanted is None else await checked(*wanted, cfg.spec_check_timeout_s, tenant)
    )
    prompt_ids = await _prompt_ids(req, codec, plan.template if plan else {}, cfg.template_timeout_s, tenant)
    prompt_ids = truncated(prompt_ids, req, max_len, cfg)
    params = sampling_params(req, len(prompt_ids), max_len, cfg, structured)
    output: OutputOptions | None = plan.output if plan else None
    ctx = ResumeContext.start(api, model.name, prompt_ids, params, req.stops, output, req.include_usage)
    ctx.lora = model.lora
    shown = []
    if isinstance(req, ChatRequest):  # its images' placeholders found in the final prompt
        shown = image_prompt.placed(req.messages, codec, prompt_ids, cfg.max_request_image_bytes)
    return Prepared(prompt_ids, params, ctx, compile_s, req.cache_salt or "", shown)


async def chat_prompt(
    req: ChatRequest, model: ServedModel, cfg: GatewayConfig, *, tenant: str = ""
) -> list[int]:
    """A chat's prompt token ids (its template, tools and system), and nothing more of
    its preparation (no constraint compiled): what `count_tokens` and `/tokenize` report."""
    check_sight(req, model)
    plan = plan_chat(req, model.codec, model.name, cfg.tool_parser)
    return await _prompt_ids(req, model.codec, plan.template, cfg.template_timeout_s, tenant)


def check_sight(req: ChatRequest | CompletionRequest, model: ServedModel) -> None:
    """A 400 naming the first image of a request to a model that cannot see: before any
    other work for it, and before it is sent to an engine."""
    if model.sees_images or not isinstance(req, ChatRequest):
        return
    part = next((p for m in req.messages for _, p in m.image_parts), None)
    if part is not None:
        msg = f"model {model.served_as!r} cannot see images (it reads text only); send text"
        raise APIError(400, "invalid_request", f"{part.where}: {msg}", param=part.where)


def truncated(
    ids: list[int], req: ChatRequest | CompletionRequest, max_len: int, cfg: GatewayConfig
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last N tokens (-1: as many as leave
    room for `max_tokens`, the request's or --default-max-tokens, in the context); N past
    the context is a 400 naming it."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == -1:
        keep = max(1, max_len - (req.requested_max_tokens or min(cfg.default_max_tokens, max_len - 1)))
    elif keep == 0 or keep > max_len:
        why = "must be -1 or at least 1" if keep == 0 else f"at most this model's context of {max_len}"
        raise APIError(
            400, "invalid_request", f"truncate_prompt_tokens: {why} (got {keep})", "truncate_prompt_tokens"
        )
    return ids[-keep:]


def with_special_tokens(codec: TextCodec, ids: list[int]) -> list[int]:
    """A chat prompt (written by its template) with the special tokens the tokenizer adds
    around a text (vLLM's `add_special_tokens` on a chat: a BOS before the template's own,
    say): found by encoding one character with and without them."""
    bare, full = codec.encode("a", add_special_tokens=False), codec.encode("a", add_special_tokens=True)
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), len(full))
    return full[:at] + ids + full[at + len(bare) :]


async def text_tokens(model: ServedModel, text: str, add_special_tokens: bool = True) -> list[int]:
    """A text's token ids, as a completion prompt is tokenized (`/tokenize`)."""
    encode = functools.partial(model.codec.encode, add_special_tokens=add_special_tokens)
    return await _run_text(encode, text, len(text))


async def detokenize(codec: TextCodec, ids: list[int], param: str = "tokens") -> str:
    """The text of token ids, special tokens kept (`/detokenize`); a 400 naming `param`
    for an id outside the vocabulary."""
    _vocab(codec, ids, param)
    return await _run_text(codec.decode, ids, 4 * len(ids))


async def embeddings(model: ServedModel, inputs: list[str | list[int]], max_len: int) -> list[Prepared]:
    """Each input of an embeddings call as a request: a text tokenized as a completion
    prompt is (all of them off the event loop when they are long), token ids checked
    against the vocabulary; each within the model's context. Its charge at admission was
    its prompt plus one."""
    codec = model.codec
    where = ["input" if len(inputs) == 1 else f"input.{i}" for i in range(len(inputs))]
    texts = [x for x in inputs if isinstance(x, str)]
    for x, at in zip(inputs, where, strict=True):
        if isinstance(x, str):
            _fits(codec, len(x), max_len, at)
    encoded = iter(await _run_text(lambda ts: [codec.encode(t) for t in ts], texts, sum(map(len, texts))))
    out = []
    for x, at in zip(inputs, where, strict=True):
        ids = next(encoded) if isinstance(x, str) else x
        if not ids:
            raise APIError(400, "invalid_request", f"{at}: must not be empty (it has no tokens)", param=at)
        if len(ids) > max_len:
            msg = f"{at}: has {len(ids)} tokens, beyond the model's context of {max_len}"
            raise APIError(400, "context_length_exceeded", msg, param=at)
        _vocab(codec, ids, at)
        params = SamplingParams(max_tokens=1, pooling="auto")  # the engine never samples it
        ctx = ResumeContext.start(Api.EMBEDDINGS, model.name, ids, params, [])
        ctx.lora = model.lora
        out.append(Prepared(ids, params, ctx))
    return out


async def checked(
    spec: dict[str, Any], param: str, limit_s: float, tenant: str = ""
) -> tuple[dict[str, Any], float]:
    """`spec` and the seconds its check took, compiled once with llguidance in the check
    pool (in `tenant`'s turn): one that does not compile, or not within `limit_s`, is a
    400 naming `param`."""
    try:
        took = await programs.check(spec, limit_s, tenant)
    except ValueError as e:
        raise APIError(400, "invalid_request", f"{param}: {e}", param=param) from None
    return spec, took


def _prompt_chars(req: ChatRequest | CompletionRequest) -> int:
    """The characters of a request's prompt text (0 for token ids)."""
    if isinstance(req, ChatRequest):
        return sum(len(m.text) for m in req.messages)
    p = req.single
    return (len(p) if isinstance(p, str) else 0) + len(req.suffix or "")


def _fits(codec: TextCodec, chars: int, max_len: int, param: str) -> None:
    """A 400 for a text that even the vocabulary's longest tokens could not fit in the
    context, before it is tokenized (a megabyte would take the gateway a second)."""
    if chars > max_len * codec.max_token_chars:
        raise APIError(
            400,
            "context_length_exceeded",
            f"{param}: {chars} characters are more than this model's context of {max_len} tokens can hold",
            param=param,
        )


def _check_vocab(codec: TextCodec, req: ChatRequest | CompletionRequest) -> None:
    """Every token id a request gives is in the model's vocabulary (the schema only
    bounds them): its stop ids, its prompt's ids, its logit_bias keys."""
    _vocab(codec, req.stop_token_ids or [], "stop_token_ids")
    if isinstance(req, CompletionRequest) and isinstance(req.single, list):
        _vocab(codec, req.single, "prompt")
    _vocab(codec, list(req.token_bias or {}), "logit_bias")


def _vocab(codec: TextCodec, ids: list[int], param: str) -> None:
    bad = next((t for t in ids if t >= codec.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            "invalid_request",
            f"{param}: token id {bad} is not in the vocabulary (size {codec.vocab_size})",
            param=param,
        )


async def _prompt_ids(
    req: ChatRequest | CompletionRequest,
    codec: TextCodec,
    template: dict[str, Any],
    template_timeout_s: float,
    tenant: str,
) -> list[int]:
    if isinstance(req, CompletionRequest):
        prompt = req.single
        if isinstance(prompt, list):
            return list(prompt)
        if req.suffix is not None:  # the schema let it through with one text prompt only
            return await _fim_ids(codec, prompt, req.suffix)
        encode_text = functools.partial(codec.encode, add_special_tokens=req.add_special_tokens)
        return await _run_text(encode_text, prompt, len(prompt))
    if codec.tiling is not None:  # a model that sees: its images' placeholders written in
        encode = functools.partial(image_prompt.encode_chat, codec, req.messages, template)
    else:
        encode = functools.partial(
            codec.encode_chat, [m.as_template_input() for m in req.messages], **template
        )
    try:  # a template is a program: always off the loop, on its pool, with a deadline
        ids = await programs.render(encode, template_timeout_s, tenant)
        return with_special_tokens(codec, ids) if req.add_special_tokens else ids
    except TimeoutError:
        why = f"messages: the chat template took longer than {template_timeout_s:g}s on these messages"
        raise APIError(400, "invalid_request", why, param="messages") from None
    except TemplateError as e:
        raise APIError(400, "invalid_request", f"messages: {e}", param="messages") from None


async def _fim_ids(codec: TextCodec, prefix: str, suffix: str) -> list[int]:
    """A fill-in-the-middle prompt; the 400 names `suffix` for a model without FIM tokens."""
    try:
        build = functools.partial(fim_prompt, codec, prefix)
        return await _run_text(build, suffix, len(prefix) + len(suffix))
    except ValueError as e:
        raise APIError(400, "invalid_request", f"suffix: {e}", param="suffix") from None


async def _run_text(fn: Callable[[T], R], arg: T, size: int) -> R:
    """`fn(arg)`, off the event loop when `arg` is large (`size` characters)."""
    if size <= _TOKENIZE_INLINE_CHARS:
        return fn(arg)
    return await textwork.run(fn, arg)


def sampling_params(
    req: ChatRequest | CompletionRequest,
    prompt_len: int,
    max_model_len: int | None,
    cfg: GatewayConfig,
    structured: dict[str, Any] | None = None,
) -> SamplingParams:
    """Engine parameters for a checked request whose prompt has `prompt_len` tokens;
    `structured` is the checked constraint (`req.structured` or a forced tool call)."""
    room = None if max_model_len is None else max_model_len - prompt_len
    param = "messages" if isinstance(req, ChatRequest) else "prompt"
    if room is not None and room < 1:
        raise APIError(
            400,
            "context_length_exceeded",
            f"{param}: the prompt has {prompt_len} tokens; this model's context is {max_model_len}",
            param=param,
        )
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens if room is None else min(cfg.default_max_tokens, room)
    elif room is not None and max_tokens > room:
        raise APIError(
            400,
            "context_length_exceeded",
            f"max_tokens: {max_tokens} plus the prompt's {prompt_len} tokens exceed this model's "
            f"context of {max_model_len}",
            param="max_tokens",
        )
    try:
        params = SamplingParams(
            n=req.n or 1,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens or 0, max_tokens),
            # Below GREEDY_BELOW sampling is greedy: say so, rather than divide by ~0.
            temperature=1.0
            if req.temperature is None
            else (0.0 if req.temperature < GREEDY_BELOW else req.temperature),
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if not req.top_k else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            logprobs=req.num_top_logprobs,
            structured=structured,
            logit_bias=req.token_bias,
            prompt_logprobs=_prompt_logprobs(req),
            **_beam_fields(req),
        )
    except ValueError as e:  # SamplingParams' own checks: its message names the field
        raise APIError(400, "invalid_request", str(e)) from None
    _check_table(params, prompt_len, cfg)
    return params


def _check_table(params: SamplingParams, prompt_len: int, cfg: GatewayConfig) -> None:
    """A prompt-logprobs table within --max-prompt-logprobs entries (a 400 past it): it is
    computed by the engine, sent on the wire and rendered as JSON by the gateway."""
    entries = prompt_logprobs_entries(params, prompt_len)
    if entries > cfg.max_prompt_logprobs:
        raise APIError(
            400,
            "invalid_request",
            f"prompt_logprobs: {prompt_len} prompt tokens x ({params.prompt_logprobs} + 1) is {entries} "
            f"entries; this server's limit is {cfg.max_prompt_logprobs}",
            param="prompt_logprobs",
        )


def _prompt_logprobs(req: ChatRequest | CompletionRequest) -> int | None:
    """Prompt logprobs to compute: vLLM's `prompt_logprobs`, or `logprobs` with `echo`
    (OpenAI then gives the prompt's tokens logprobs too) on a completion."""
    if not isinstance(req, CompletionRequest):
        return req.prompt_logprobs
    if req.prompt_logprobs is not None:
        return (
            max(req.prompt_logprobs, req.logprobs or 0)
            if req.echo and req.logprobs is not None
            else req.prompt_logprobs
        )
    return req.logprobs if req.echo and req.logprobs is not None else None


def _beam_fields(req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    if not isinstance(req, CompletionRequest) or not req.use_beam_search:
        return {}
    n = req.n or 1
    return {
        "use_beam_search": True,
        "beam_width": req.beam_width or max(4, n),
        "length_penalty": 1.0 if req.length_penalty is None else req.length_penalty,
        "early_stopping": bool(req.early_stopping),
    }
