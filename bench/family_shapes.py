"""The random-weight GGUFs of bench/families.py: Gemma-3-4B's whole model and gpt-oss-20b's layer
shapes, each tensor and key as llama.cpp's converter writes them (gguf-py's names; what
src/models/gemma3.cpp and openai-moe.cpp load) and as wsllm's loader reads them
(wsllm/models/gemma3.py, gpt_oss.py, gguf_plan.py).

Gemma 3 ("gemma3"): q, k, v, o, gate, up, down in Q4_0; the embedding Q4_0 and tied (no
`output.weight`: both servers use the embedding as the output layer); every norm F32 and already
holding Gemma's 1 + w (as the converter writes it): attn_norm, attn_q_norm and attn_k_norm (over a
head), post_attention_norm and post_ffw_norm (the sandwich), ffn_norm (before the feed-forward).
Keys: 1024-token windows on 5 of every 6 layers (`attention.sliding_window`,
`sliding_window_pattern` 6: layers 5, 11, ... full, as HF's layer_types), rotary bases 1M on the full
layers with the 4B's linear scaling (factor 8) and 10k unscaled on the windowed ones
(`rope.freq_base_swa`), q.k scaled by query_pre_attn_scalar ** -0.5 = head_dim ** -0.5 (both
servers' rule for every size but the 27B; the file says nothing of it), no soft-caps.

gpt-oss ("gpt-oss"): q, k, v, o in Q4_0 with F32 biases, F32 sinks per head, the router F32 with its
bias, the experts' gate, up and down apart in MXFP4 ([E, rows, cols]) with F32 biases [E, rows];
128-token windows on the even layers (both servers' pattern for gpt-oss), YaRN (factor 32 over
4,096 positions, base 150k), its own output layer."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_gguf  # noqa: E402  (a sibling script, not a package)

Spec = random_gguf.Spec


@dataclass(frozen=True, slots=True)
class Gemma3Shape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    window: int = 1024
    pattern: int = 6  # every pattern-th layer full, the others windowed
    rope_theta: float = 1e6
    rope_local_theta: float = 1e4
    rope_linear: float = 8.0  # the full layers' linear rotary scaling (4B and up)
    ctx: int = 131072
    arch: str = "gemma3"
    byte_tokenizer: bool = False  # random_gguf.add_byte_tokenizer instead of SmolLM2's (the check)

    def tensors(self) -> list[Spec]:
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        out: list[Spec] = [("token_embd.weight", "Q4_0", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", "F32", (h,)),
                (b + "attn_q.weight", "Q4_0", (q, h)),
                (b + "attn_k.weight", "Q4_0", (kv, h)),
                (b + "attn_v.weight", "Q4_0", (kv, h)),
                (b + "attn_output.weight", "Q4_0", (h, q)),
                (b + "attn_q_norm.weight", "F32", (self.head_dim,)),
                (b + "attn_k_norm.weight", "F32", (self.head_dim,)),
                (b + "post_attention_norm.weight", "F32", (h,)),
                (b + "ffn_norm.weight", "F32", (h,)),
                (b + "ffn_gate.weight", "Q4_0", (self.ff, h)),
                (b + "ffn_up.weight", "Q4_0", (self.ff, h)),
                (b + "ffn_down.weight", "Q4_0", (h, self.ff)),
                (b + "post_ffw_norm.weight", "F32", (h,)),
            ]
        return out + [("output_norm.weight", "F32", (h,))]

    def metadata(self, w: Any) -> None:
        import gguf

        _common(w, self, self.ff)
        w.add_rope_freq_base(self.rope_theta)
        w.add_rope_freq_base_swa(self.rope_local_theta)
        if self.rope_linear != 1.0:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(self.rope_linear)
        w.add_sliding_window(self.window)
        w.add_sliding_window_pattern(self.pattern)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)

    def fill(self, rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)  # norms: 1 + w, w near 0


@dataclass(frozen=True, slots=True)
class GptOssShape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ff: int
    window: int = 128
    rope_theta: float = 150000.0
    yarn_factor: float = 32.0
    yarn_original_ctx: int = 4096
    ctx: int = 131072
    arch: str = "gpt-oss"
    byte_tokenizer: bool = False  # random_gguf.add_byte_tokenizer instead of SmolLM2's (the check)

    def tensors(self) -> list[Spec]:
        q, kv, h, e, ff = (
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.hidden,
            self.experts,
            self.expert_ff,
        )
        out: list[Spec] = [("token_embd.weight", "Q4_0", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", "F32", (h,)),
                (b + "attn_q.weight", "Q4_0", (q, h)),
                (b + "attn_q.bias", "F32", (q,)),
                (b + "attn_k.weight", "Q4_0", (kv, h)),
                (b + "attn_k.bias", "F32", (kv,)),
                (b + "attn_v.weight", "Q4_0", (kv, h)),
                (b + "attn_v.bias", "F32", (kv,)),
                (b + "attn_output.weight", "Q4_0", (h, q)),
                (b + "attn_output.bias", "F32", (h,)),
                (b + "attn_sinks.weight", "F32", (self.heads,)),
                (b + "post_attention_norm.weight", "F32", (h,)),
                (b + "ffn_gate_inp.weight", "F32", (e, h)),
                (b + "ffn_gate_inp.bias", "F32", (e,)),
                (b + "ffn_gate_exps.weight", "MXFP4", (e, ff, h)),
                (b + "ffn_gate_exps.bias", "F32", (e, ff)),
                (b + "ffn_up_exps.weight", "MXFP4", (e, ff, h)),
                (b + "ffn_up_exps.bias", "F32", (e, ff)),
                (b + "ffn_down_exps.weight", "MXFP4", (e, h, ff)),
                (b + "ffn_down_exps.bias", "F32", (e, h)),
            ]  # fmt: skip
        return out + [("output_norm.weight", "F32", (h,)), ("output.weight", "Q4_0", (self.vocab, h))]

    def metadata(self, w: Any) -> None:
        import gguf

        _common(w, self, self.expert_ff)
        w.add_rope_freq_base(self.rope_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(self.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(self.yarn_original_ctx)
        w.add_sliding_window(self.window)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_expert_count(self.experts)
        w.add_expert_used_count(self.top_k)
        w.add_expert_feed_forward_length(self.expert_ff)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)

    def fill(self, rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("ffn_gate_inp.weight"):  # a router that spreads the tokens over the experts
            v = rng.normal(0, 0.05, size=shape)
        elif name.endswith("attn_sinks.weight"):  # a learned logit per head, of the order of q.k's
            v = rng.uniform(-1.0, 1.0, size=shape)
        elif name.endswith(".bias"):
            v = rng.normal(0, 0.02, size=shape)
        else:  # norms
            v = rng.uniform(0.8, 1.2, size=shape)
        return v.astype(np.float32)


def _common(w: Any, s: Gemma3Shape | GptOssShape, ff: int) -> None:
    w.add_block_count(s.layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(s.vocab)
    if s.byte_tokenizer:
        random_gguf.add_byte_tokenizer(w, s.vocab)
    else:
        random_gguf.add_tokenizer(w, s.vocab)


Shape = Gemma3Shape | GptOssShape
GEMMA3_4B = Gemma3Shape("Gemma-3-4B", 262144, 2560, 34, 8, 4, 256, 10240)
GPT_OSS_20B = GptOssShape("gpt-oss-20b layers", 201088, 2880, 24, 64, 8, 64, 32, 4, 2880)
SHAPES: dict[str, Shape] = {"gemma3": GEMMA3_4B, "gpt-oss": GPT_OSS_20B}
#: the smoke's shapes: every piece of the real ones (windows shorter than its prompts, a full
#: layer among the windowed ones, sinks, MXFP4 experts) at a few MB, SmolLM2's vocabulary
TINY: dict[str, Shape] = {
    "gemma3": replace(GEMMA3_4B, name="tiny Gemma 3", vocab=49152, hidden=256, layers=6, heads=4, kv_heads=2,
                      head_dim=64, ff=512, window=32, ctx=4096),
    "gpt-oss": replace(GPT_OSS_20B, name="tiny gpt-oss", vocab=49152, hidden=256, layers=4, heads=8, kv_heads=2,
                       head_dim=32, experts=8, top_k=2, expert_ff=256, window=16, ctx=4096),
}  # fmt: skip
#: bench/families.py --check's: the tiny shapes with a vocabulary of 512 and the byte tokenizer,
#: which wsllm loads in about a second (for the unit test; no server reads them)
CHECK: dict[str, Shape] = {k: replace(s, vocab=512, byte_tokenizer=True) for k, s in TINY.items()}


def full_attention_kv_bytes(s: Shape, tokens: int, elem: int = 2) -> int:
    """K and V of `tokens` tokens on every layer, `elem` bytes a value: what a cache without windows
    holds."""
    return 2 * s.layers * s.kv_heads * s.head_dim * elem * tokens


def file_bytes(s: Shape) -> int:
    return sum(random_gguf.nbytes(q, shape) for _, q, shape in s.tensors())


def write(path: Path, s: Shape, seed: int = 0) -> Path:
    """The shape's random-weight GGUF at `path`, written once, tensor by tensor."""
    kind = "Q4_0, MXFP4 experts" if isinstance(s, GptOssShape) else "Q4_0"
    return random_gguf.write_gguf(
        path, s.arch, f"random {s.name} {kind}", s.metadata, s.tensors(), s.fill, seed
    )
