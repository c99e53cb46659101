"""What the engine refuses before a request enters it: each refusal a ValueError (or
EngineBusy) whose message a client can act on, leaving the engine as it was. The wire's
own check (`wire.check_request`: the request's shape and bounds) came before, in the
worker; this one checks what only the engine knows: its vocabulary, context, blocks and room."""

from __future__ import annotations

from wsllm.config import EngineConfig
from wsllm.engine.kv_groups import KVManager
from wsllm.types import EngineBusy, GenerateRequest, SamplingParams


def check_admissible(
    request: GenerateRequest,
    params: SamplingParams,  # the request's, its pooling resolved to the model's
    *,
    in_use: bool,  # the id names a request the engine holds
    held: int,  # requests the engine holds
    vocab_size: int,
    max_model_len: int,
    bm: KVManager,
    config: EngineConfig,
    sees: bool = False,  # the model has an image side (models/vision/)
) -> None:
    request_id, prompt = request.request_id, request.prompt_token_ids
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string")
    if in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    if not prompt:
        raise ValueError("prompt must not be empty")
    if request.images and not sees:  # the gateway says so first; placeholders are never read as text
        raise ValueError("this model cannot see images (it reads text only)")
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
    if params.logit_bias and any(t >= vocab_size for t in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    most = 0 if params.pooling else params.max_tokens  # an embedding computes its prompt only
    total = len(prompt) + most
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({most}) is {total}, "
            f"beyond the model's context of {max_model_len} tokens"
        )
    if not bm.fits(total, config.max_num_batched_tokens):  # a windowed group holds its window only
        raise ValueError(
            f"prompt plus max_tokens ({total} tokens) needs more KV blocks than the cache has "
            f"({bm.num_blocks} blocks of {bm.block_size})"
        )
    if params.n > config.max_num_seqs:
        raise ValueError(f"n ({params.n}) must be <= max_num_seqs ({config.max_num_seqs})")
    if params.use_beam_search and params.n > params.beam_width:
        raise ValueError(f"n ({params.n}) must be <= beam_width ({params.beam_width}) with beam search")
    if params.use_beam_search and params.beam_width > config.max_num_seqs:
        raise ValueError(f"beam_width must be <= max_num_seqs ({config.max_num_seqs})")
    if held >= config.max_waiting + config.max_num_seqs:
        raise EngineBusy("the engine is full; retry later")
