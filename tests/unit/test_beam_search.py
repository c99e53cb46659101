"""Beam search over shared blocks equals Hugging Face beam search."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wsllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "My favourite fruit is",
    "Write one sentence about the ocean.",
]


def hf_beams(
    hf: Any, ids: list[int], width: int, max_new: int, lp: float, early: bool, eos: list[int]
) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=width,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=lp,
            early_stopping=early,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    toks = out[0, len(ids) :].tolist()
    for i, t in enumerate(toks):  # cut the padding after the first EOS
        if t in eos:
            return toks[: i + 1]
    return toks


@pytest.mark.parametrize("lp,early", [(1.0, False), (0.6, True)])
def test_beam_search_matches_hf(smollm_llm: LLM, smollm_hf: Any, lp: float, early: bool) -> None:
    tok = smollm_llm.tokenizer
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    params = SamplingParams(
        use_beam_search=True,
        beam_width=4,
        temperature=0.0,
        max_tokens=20,
        length_penalty=lp,
        early_stopping=early,
    )
    eng = smollm_llm.engine
    cow0 = eng.block_manager.num_cow
    results = smollm_llm.generate(chats, params)
    eos = eng.eos_token_ids
    for ids, r in zip(chats, results, strict=True):
        assert r.token_ids == hf_beams(smollm_hf, ids, 4, 20, lp, early, eos), tok.decode(ids)
    assert eng.block_manager.num_cow > cow0, "beams never shared a block"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.block_manager.check_invariants()
