"""vLLM's `/tokenize` and `/detokenize` bodies: a prompt (text) or a chat's messages to
count through the model's template, and token ids to read back; every 400 of their
shape, and their charge at admission."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from wsllm.bounds import MAX_ID_CHARS, MAX_PROMPT_TOKENS, MAX_TOKEN_ID
from wsllm.config_gateway import GatewayConfig
from wsllm.server.conversation import MAX_TOOLS, ChatMessage, ToolDef
from wsllm.server.fields import Strict
from wsllm.server.images import ImageLimits
from wsllm.server.quota import Charge, chat_prompt_tokens, prompt_charge, text_tokens
from wsllm.server.schemas import ChatRequest, body_object, validated

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class TokenizeCompletion(Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the tokenizer's special tokens (a BOS, say) on top of those the template writes
    add_special_tokens: bool = False
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def as_chat(self, cfg: GatewayConfig) -> ChatRequest:
        """The chat request whose prompt this is (for the template and its checks)."""
        req = ChatRequest.model_construct(
            messages=self.messages,
            tools=self.tools,
            chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=self.add_special_tokens,
        )
        req.check_chat(ImageLimits.of(cfg))
        return req


def charge(req: TokenizeCompletion | TokenizeChat | Detokenize, cfg: GatewayConfig) -> Charge:
    """Admitted as every call is: its prompt's coarse charge (exact for token ids)."""
    if isinstance(req, Detokenize):
        return Charge(req.model, [prompt_charge(len(req.tokens), exact=True)])
    if isinstance(req, TokenizeChat):
        return Charge(req.model, [prompt_charge(chat_prompt_tokens(req.as_chat(cfg)))])
    return Charge(req.model, [prompt_charge(text_tokens(req.prompt))])


class Detokenize(Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKENS)


def validate_tokenize(raw: bytes, cfg: GatewayConfig) -> TokenizeCompletion | TokenizeChat:
    """A /tokenize body: `prompt` (text) or `messages` (a chat), as vLLM takes them."""
    obj = body_object(raw, cfg)
    if "messages" not in obj:
        return validated(TokenizeCompletion, obj)
    req = validated(TokenizeChat, obj)
    req.as_chat(cfg)  # its checks, now
    return req


def validate_detokenize(raw: bytes, cfg: GatewayConfig) -> Detokenize:
    return validated(Detokenize, body_object(raw, cfg))
