"""The dense families beyond a Llama, one tiny random-weight model each built by transformers in the
test: Gemma 2 (sliding windows on every other layer, attention and final soft-caps, GeGLU,
sandwich norms, (1 + w) norms, the embedding scale), Gemma 3 (a rotary base per layer type, the
full layer's linear scaling, QK-norm, a query_pre_attn_scalar that is not head_dim, a final
soft-cap), Phi-3 (fused qkv and gate_up, LongRoPE's short factors and attention factor in
the generations, its long ones against HF's tables, partial rotary, a window on every layer) and SmolLM3 (a NoPE layer,
windowed), windows shorter than the prompts: greedy tokens equal HF `generate` in fp32 through the
engine; the same weights as a GGUF written here as llama.cpp writes it (its names, fused tensors,
Gemma's norms + 1, SmolLM3's Q/K permutation, Phi-3's rope factors; Q4_0 and Q8_0 inside) load in
their blocks and give logits within the dense path's tolerance of the file's de-quantized run,
which is the HF weights' run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from wsllm.kernels import quant

from wsllm import LLM, SamplingParams
from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.models.quant_linear import QuantLinear
from wsllm.types import GenerateRequest

KINDS = ["gemma2", "gemma3", "phi3", "smollm3"]
VOCAB = 2048
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
WINDOW = 8  # shorter than the prompts (9 and 40 tokens)
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,  # head_dim, as llama.cpp reads a GGUF (gemma2.gguf_query_scalar)
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        tie_word_embeddings=False,
    ),
    "gemma3": dict(
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,
        final_logit_softcapping=10.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=False,  # a tied table makes a tiny model repeat itself
    ),
    "phi3": dict(
        head_dim=None,
        max_position_embeddings=192,
        original_max_position_embeddings=64,  # generations stay within it (see test_longrope_...)
        partial_rotary_factor=0.5,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.3, 2.0, 3.5],
            "long_factor": [1.5, 2.5, 4.0, 8.0],
        },
        sliding_window=12,
        tie_word_embeddings=False,
    ),
    "smollm3": dict(
        num_hidden_layers=4,  # the fourth is NoPE (no_rope_layer_interval 4, llama.cpp's rule too)
        use_sliding_window=True,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=False,
    ),
}
# GGUF architecture of each, and the formats of its linear tensors
GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3"}
FORMATS = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_qkv": "Q4_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
    "output": "Q8_0",
}


def make_model(path: Path, tokenizer_dir: Path, kind: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in (BASE | CONFIGS[kind]).items() if v is not None}
    model_type = "gemma3_text" if kind == "gemma3" else kind
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaked, varied logits; norms away from their init (Gemma's: 1 + 0)
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's are w of (1 + w)
                lo, hi = (-0.4, 0.4) if kind.startswith("gemma") else (0.6, 1.4)
                p.uniform_(lo, hi)
            elif p.dim() > 1:
                p.normal_(0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "qkv_proj": "attn_qkv",
    "o_proj": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "gate_up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
# Gemma's sandwich norms as llama.cpp names them; a Llama's post_attention_layernorm is its ffn_norm
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_tensors(kind: str, hf_dir: Path, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The HF tensors as llama.cpp's converter writes them: its names, Gemma's norms + 1,
    SmolLM3's Q/K rows permuted (a Llama's), Phi-3's rope factors."""
    from safetensors.torch import load_file

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    out: dict[str, np.ndarray] = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        x = t.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            x = x + 1
        if parts[0] != "layers":
            out[
                {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[parts[0]]
                + ".weight"
            ] = x
            continue
        short = (_GEMMA_NORMS if kind.startswith("gemma") else {}).get(parts[-2]) or _NAMES.get(parts[-2])
        if short is None:  # a Llama's post_attention_layernorm
            short = "ffn_norm"
        if kind == "smollm3" and short in ("attn_q", "attn_k"):
            x = permute(x, cfg["num_attention_heads"] if short == "attn_q" else cfg["num_key_value_heads"])
        out[f"blk.{parts[1]}.{short}.weight"] = x
    if kind == "phi3":
        rope = cfg["rope_parameters"]
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    return out


def write_metadata(w: Any, kind: str, cfg: dict[str, Any]) -> None:
    """What llama.cpp's converter writes for `kind` (and SmolLM3's window, which it has none for)."""
    from gguf import RopeScalingType

    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if kind != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if kind == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif kind == "gemma3":
        full = cfg["rope_parameters"]["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern(2)  # llama.cpp's default is 6: this file's layers alternate
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    elif kind == "phi3":
        rot = int(head_dim * cfg["partial_rotary_factor"])
        w.add_rope_dimension_count(rot)
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(cfg["original_max_position_embeddings"])))
        )
        w.add_sliding_window(cfg["sliding_window"])
    else:
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_sliding_window(cfg["sliding_window"])


def make_gguf(path: Path, hf_dir: Path, kind: str, add_tokenizer: Any) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = BASE | CONFIGS[kind]
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[kind])
    write_metadata(w, kind, cfg)
    add_tokenizer(w, VOCAB)
    for name, x in gguf_tensors(kind, hf_dir, cfg).items():
        qtype = FORMATS.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0])
        if qtype is None:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Any:
    """`dense(kind)`: the kind's tiny HF directory, made once."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_model(tmp_path_factory.mktemp(f"tiny-{kind}"), smollm_dir, kind)
        return made[kind]

    return get


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory: pytest.TempPathFactory, dense: Any, gguf_tokenizer: Any) -> Any:
    """`dense_gguf(kind)`: the kind's tiny model as a GGUF (FORMATS), made once."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            path = tmp_path_factory.mktemp(f"tiny-{kind}-gguf") / f"tiny-{kind}.gguf"
            made[kind] = make_gguf(path, dense(kind), kind, gguf_tokenizer)
        return made[kind]

    return get


def prompts(lengths: tuple[int, ...] = (9, 40), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf: Any, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def make_engine(model: Path, **kw: Any) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model=str(model), dtype="float32", kv_cache_gb=0.05, kv_cache_dtype="float32", **kw)
    )


def prompt_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    engine.add_request(GenerateRequest("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            got = o.prompt_logprobs if o.prompt_logprobs is not None else got
    assert got is not None
    return torch.tensor([p[0] for p in got[1:]])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_generate(kind: str, dense: Any) -> None:
    from transformers import AutoModelForCausalLM

    path = dense(kind)
    saved = json.loads((path / "config.json").read_text())
    assert saved.get("sliding_window") == CONFIGS[kind]["sliding_window"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(model=str(path), kv_cache_gb=0.05, dtype="float32", kv_cache_dtype="float32")
    batch = prompts()
    results = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for ids, r in zip(batch, results, strict=True):
        assert r.token_ids == hf_greedy(hf, ids, 16)
    assert len({t for r in results for t in r.token_ids}) > 8, "a model that repeats itself tests little"


@pytest.mark.parametrize("kind", KINDS)
def test_its_gguf_runs_in_its_blocks_within_the_dense_tolerance(
    kind: str, dense: Any, dense_gguf: Any
) -> None:
    """The quantized run against the file's de-quantized run (the dense path's bound: 0.1 nats on
    average, 1 at most); and that de-quantized run against the HF weights it was written from (the
    names, Gemma's norms, the rope factors, the un-permutation: a wrong reading moves it by nats)."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    path = dense_gguf(kind)
    blocks, float_run = make_engine(path), make_engine(path, quantization="none")
    kept = {m.qweight.qtype for m in blocks.runner.model.modules() if isinstance(m, QuantLinear)}
    assert kept == {"Q4_0", "Q8_0"}
    ids = prompts((60,), seed=1)[0]
    quantized, dequantized = prompt_logprobs(blocks, ids), prompt_logprobs(float_run, ids)
    diff = (quantized - dequantized).abs()
    assert diff.mean() < 0.1 and diff.max() < 1.0, (diff.mean(), diff.max())
    hf = prompt_logprobs(make_engine(dense(kind)), ids)
    assert (dequantized - hf).abs().mean() < 0.2


def test_the_decode_stack_runs_gemma3s_layers_with_their_bits(dense_gguf: Any) -> None:
    """Gemma 3's decode-only steps in the one native call (GeGLU, the sandwich norms without the
    residual, QK-norm, its sliding layers' own rotary table beside the full layers') give the
    layer-by-layer logits, bit for bit."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    got = {}
    for fused in (True, False):
        engine = make_engine(dense_gguf("gemma3"), enable_prefix_caching=False)
        model = engine.runner.model
        model.fused_decode = fused
        seen: list[torch.Tensor] = []
        compute = model.compute_logits
        model.compute_logits = lambda h, seen=seen, compute=compute: seen.append(compute(h)) or seen[-1]  # type: ignore[method-assign]
        for i, p in enumerate(prompts((3, 20, 5))):
            engine.add_request(
                GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            )
        while engine.has_unfinished():
            engine.step()
        assert (model._stack is not None and model._stack[2] is not None) == fused
        got[fused] = seen
    assert len(got[True]) == len(got[False]) > 3
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b)


def test_geglu_in_triton_equals_its_reference() -> None:
    """GeGLU's Triton kernel (the interpreter on a CPU) against the torch op: fp32 to a few ulps,
    bf16 within two ulps (gelu rounded once, then the product)."""
    from wsllm.kernels.activation import gelu_tanh_and_mul_ref

    from wsllm import kernels

    if not kernels.triton_available():
        pytest.skip("no triton")
    from wsllm.kernels.elementwise import gelu_tanh_and_mul_triton

    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(3)) * 3
    torch.testing.assert_close(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_ref(x), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    diff = (gelu_tanh_and_mul_triton(xb).float() - gelu_tanh_and_mul_ref(xb).float()).abs()
    assert (diff <= gelu_tanh_and_mul_ref(xb).float().abs() * 2**-6 + 1e-6).all()  # two bf16 ulps


def test_longrope_tables_are_hfs_short_below_the_original_length_and_long_from_it(dense: Any) -> None:
    """Phi-3's rotary rows (partial: the first 8 of 16 dimensions) against HF's own rotary at the
    same positions: the short factors below original_max_position_embeddings (a call that stays
    there), the long ones from it (a call that reaches past it: HF's long set)."""
    from transformers import AutoModelForCausalLM

    from wsllm.models.loader import read_hf_config
    from wsllm.models.registry import model_config
    from wsllm.models.rope import rotary_cache

    path = dense("phi3")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    table = rotary_cache(model_config(read_hf_config(path)))  # [max_pos, 16]: cos 8 | sin 8
    x = torch.zeros(1, 1, 16)
    for lo, hi in ((0, 64), (64, 192)):
        # one call over [0, hi): HF takes the long set for the whole call once it reaches past 64
        cos, sin = hf.model.rotary_emb(x, position_ids=torch.arange(0, hi)[None])
        ours = table[lo:hi]
        torch.testing.assert_close(ours[:, :4], cos[0, lo:hi, :4], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[:, 8:12], sin[0, lo:hi, :4], rtol=0, atol=1e-6)
        assert torch.equal(ours[:, 4:8], torch.ones(hi - lo, 4))  # the dimensions rotary leaves alone
        assert torch.equal(ours[:, 12:], torch.zeros(hi - lo, 4))
