"""Offline API: `LLM(model=None).generate(prompts, params)`; with
`SamplingParams(pooling="auto" | "last" | "mean")` each result's `embedding`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from wsllm.config import EngineConfig
from wsllm.types import GenerateRequest, SamplingParams


@dataclass(slots=True)
class Choice:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[Any] | None = None


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Choice] = field(default_factory=list)
    num_cached_tokens: int = 0
    # params.prompt_logprobs: per prompt token, None for the first, else (logprob, ((token, logprob), ...top N))
    prompt_logprobs: list[Any] | None = None
    # params.pooling set: the prompt's pooled last hidden state (not normalized); no choices' tokens
    embedding: list[float] | None = None

    # The first choice, for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(self, model: str | None = None, quantization: str = "auto", **engine_args: Any) -> None:
        """`quantization`: auto (a GGUF computed in its quantized blocks on the CPU) |
        none | q8_0 | q4_0 (a float checkpoint quantized at load); the other
        EngineConfig fields as keywords."""
        from transformers import AutoTokenizer

        from wsllm.engine.engine import LLMEngine

        config = EngineConfig(model=model, quantization=quantization, **engine_args)
        self.engine = LLMEngine.from_config(config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.engine.model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | list[str] = "",
    ) -> list[GenerationResult]:
        """Generate for every prompt at once (one batch). `lora`: the LoRA adapter (a name
        loaded with `lora=["NAME=PATH"]`; "": the base) of every prompt, or one per prompt."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapters for {len(prompts)} prompts")
        order: list[str] = []
        results: dict[str, GenerationResult] = {}
        added: list[str] = []
        try:
            for prompt, p, name in zip(prompts, plist, loras, strict=True):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)  # type: ignore[arg-type]
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(GenerateRequest(rid, ids, p, lora=name))
                added.append(rid)
                order.append(rid)
                results[rid] = GenerationResult(rid, ids)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            self.engine.step()  # flush the aborts
            raise
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
        pending = set(order)
        while pending:
            for out in self.engine.step():
                if out.request_id not in pending:
                    continue
                if out.prompt_logprobs is not None:
                    results[out.request_id].prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    r = results[out.request_id]
                    r.num_cached_tokens = out.num_cached_tokens
                    r.embedding = out.embedding
                    r.outputs = [
                        Choice(
                            c.index,
                            c.token_ids,
                            self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                            c.finish_reason,
                        )
                        for c in out.outputs
                    ]
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [results[r] for r in order]
