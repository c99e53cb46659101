"""gpt-oss on a tiny random-weight GptOss built by transformers (tests/conftest.py: tiny_gpt_oss:
biases on q, k, v, o, the router and every expert, sinks of 0.5..2, layer 0 windowed to 8 tokens,
YaRN rotary, a swiglu limit that clamps): greedy tokens equal HF `generate` in fp32 on prompts
longer than the window, and each of those pieces changes HF's tokens (so the equality tests it);
its GGUF (MXFP4 experts, Q4_0/Q8_0 attention, llama.cpp's names) runs with the experts in their
blocks within the dense path's tolerance of its de-quantized run, which reads the HF weights; its
decode-only steps in the native decode stack give the layer-by-layer bits; an HF checkpoint with
MXFP4 experts (the released layout) loads as its de-quantized float twin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_moe_models import hf_greedy, make_engine, prompt_logprobs, prompts
from wsllm.kernels import quant

from wsllm import LLM, SamplingParams
from wsllm.models.quant_linear import QuantExpertsModule
from wsllm.types import GenerateRequest


@pytest.fixture(scope="module")
def hf_model(tiny_gpt_oss: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_gpt_oss), dtype=torch.float32).eval()


def test_greedy_tokens_equal_hf_generate(tiny_gpt_oss: Path, hf_model: Any) -> None:
    llm = LLM(model=str(tiny_gpt_oss), kv_cache_gb=0.05, dtype="float32", kv_cache_dtype="float32")
    batch = prompts((3, 17, 40))
    results = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for ids, r in zip(batch, results, strict=True):
        assert r.token_ids == hf_greedy(hf_model, ids, 16)
    assert len({t for r in results for t in r.token_ids}) > 8, "a model that repeats itself tests little"


def test_each_piece_of_gpt_oss_changes_hf_s_tokens(hf_model: Any) -> None:
    """Without its sinks, its window, its clamp or its expert biases the HF model answers
    otherwise: the equality above holds only with each of them in place."""
    ids = prompts((40,))[0]
    want = hf_greedy(hf_model, ids, 16)
    layers = hf_model.model.layers
    zeroed = {
        "sinks": [layer.self_attn.sinks for layer in layers],
        "expert biases": [layer.mlp.experts.down_proj_bias for layer in layers],
    }
    for what, params in zeroed.items():
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.zero_()
        try:
            assert hf_greedy(hf_model, ids, 16) != want, what
        finally:
            with torch.no_grad():
                for p, v in zip(params, saved, strict=True):
                    p.copy_(v)
    limits = [layer.mlp.experts.limit for layer in layers]
    for layer in layers:
        layer.mlp.experts.limit = 1e9
    try:
        assert hf_greedy(hf_model, ids, 16) != want, "the clamp"
    finally:
        for layer, limit in zip(layers, limits, strict=True):
            layer.mlp.experts.limit = limit
    types = hf_model.config.layer_types
    hf_model.config.layer_types = ["full_attention"] * len(types)
    try:
        assert hf_greedy(hf_model, ids, 16) != want, "the window"
    finally:
        hf_model.config.layer_types = types
    assert hf_greedy(hf_model, ids, 16) == want


def test_its_gguf_runs_in_its_blocks_within_the_dense_tolerance(
    tiny_gpt_oss: Path, tiny_gpt_oss_gguf: Path
) -> None:
    """MXFP4 experts in their blocks (the native pass with the biases and the clamped SwiGLU)
    against the file's de-quantized run (0.1 nats on average, 1 at most); that run against the HF
    weights it was written from (the names, the sinks, the experts' split of gate and up)."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    blocks, dense = make_engine(tiny_gpt_oss_gguf), make_engine(tiny_gpt_oss_gguf, quantization="none")
    experts = [m for m in blocks.runner.model.modules() if isinstance(m, QuantExpertsModule)]
    assert len(experts) == 2
    assert {(m.qexperts.gate.qtype, m.qexperts.up.qtype, m.qexperts.down.qtype) for m in experts} == {
        ("MXFP4", "MXFP4", "MXFP4")
    }
    ids = prompts((60,), seed=1)[0]
    quantized, dequantized = prompt_logprobs(blocks, ids), prompt_logprobs(dense, ids)
    diff = (quantized - dequantized).abs()
    assert diff.mean() < 0.1 and diff.max() < 1.0, (diff.mean(), diff.max())
    hf = prompt_logprobs(make_engine(tiny_gpt_oss), ids)
    assert (dequantized - hf).abs().mean() < 0.3


def test_the_decode_stack_runs_its_layers_with_their_bits(tiny_gpt_oss_gguf: Path) -> None:
    """Decode-only steps in the one native call (o's bias, the sinks and the window in its
    attention op, the MoE op with its biases and clamp) give the layer-by-layer logits, bit for
    bit, past the window."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    got = {}
    for fused in (True, False):
        engine = make_engine(tiny_gpt_oss_gguf, enable_prefix_caching=False)
        model = engine.runner.model
        model.fused_decode = fused
        seen: list[torch.Tensor] = []
        compute = model.compute_logits
        model.compute_logits = lambda h, seen=seen, compute=compute: seen.append(compute(h)) or seen[-1]  # type: ignore[method-assign]
        for i, p in enumerate(prompts((3, 9, 5))):
            engine.add_request(
                GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
            )
        while engine.has_unfinished():
            engine.step()
        assert (model._stack is not None and model._stack[2] is not None) == fused
        got[fused] = seen
    assert len(got[True]) == len(got[False]) > 3
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b)


def _hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [..., K] -> (HF's MXFP4 blocks uint8 [..., K / 32, 16], scales [..., K / 32], the
    values they hold), quantized and de-quantized by gguf (whose byte j holds values j and j + 16
    of its block, where HF's holds 2j and 2j + 1; the same E8M0 exponent)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    x = w.float().numpy()
    raw = quants.quantize(x, GGMLQuantizationType.MXFP4)
    values = quants.dequantize(raw, GGMLQuantizationType.MXFP4).reshape(x.shape)
    raw = raw.reshape(*x.shape[:-1], -1, 17)
    nibbles = np.concatenate([raw[..., 1:] & 0x0F, raw[..., 1:] >> 4], axis=-1)  # the 32 in order
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(raw[..., 0].copy()), torch.from_numpy(values)


def test_an_mxfp4_hf_checkpoint_loads_as_its_float_twin(tmp_path: Path, tiny_gpt_oss: Path) -> None:
    """The released layout: each expert projection as MXFP4 `*_blocks` and `*_scales` (rows the
    outputs), `quantization_config` mxfp4; it gives the prompt logprobs of the same weights saved
    de-quantized in HF's float layout, bit for bit."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_gpt_oss / "model.safetensors"))
    mx, twin = dict(state), dict(state)
    for name in [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales, values = _hf_mxfp4(state[name].transpose(1, 2))  # [E, out, in]
        del mx[name]
        mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
        twin[name] = values.transpose(1, 2).contiguous()
    dirs = {}
    for kind, weights in (("mxfp4", mx), ("float", twin)):
        d = dirs[kind] = tmp_path / kind
        shutil.copytree(tiny_gpt_oss, d)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
    cfg = json.loads((dirs["mxfp4"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dirs["mxfp4"] / "config.json").write_text(json.dumps(cfg))
    ids = prompts((20,), seed=2)[0]
    got, want = (prompt_logprobs(make_engine(dirs[k]), ids) for k in ("mxfp4", "float"))
    assert torch.equal(got, want)
    assert not torch.equal(want, prompt_logprobs(make_engine(tiny_gpt_oss), ids))  # it was quantized


@pytest.mark.parametrize(
    "rope",
    [
        {},  # gpt-oss's own: factor 32 over 4096, beta 32 / 1, the ramp not truncated
        {"truncate": True, "factor": 4.0, "original_max_position_embeddings": 256},
        {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16},  # DeepSeek's knobs
        {"attention_factor": 1.25},
    ],
)
def test_yarn_rotary_equals_transformers(rope: dict[str, Any]) -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from wsllm import kernels

    gpt_oss = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    params = {"rope_type": "yarn", "rope_theta": 150000.0, "original_max_position_embeddings": 4096}
    params |= gpt_oss | rope
    cfg = GptOssConfig(head_dim=64, max_position_embeddings=8192, rope_parameters=dict(params))
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    freqs = torch.outer(torch.arange(8192).float(), inv_freq)
    want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention
    got = kernels.compute_cos_sin_cache(64, params["rope_theta"], 8192, params)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
