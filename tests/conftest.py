"""Session-wide fixtures: the real SmolLM2 (converted once, cached), and tiny
random-weight models built from configs in the test, sharing SmolLM2's tokenizer."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Without a GPU, Triton kernels can only run in its interpreter. Triton reads this when
# a kernel is decorated, so it must be set before any test module imports one.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a cached HF directory."""
    from wsllm.models.loader import resolve_model_dir

    return resolve_model_dir(None)


def make_tiny_model(path: Path, tokenizer_dir: Path, kind: str = "llama", **overrides: Any) -> Path:
    """Save a random-weight HF model of `kind` (llama | llama3 | qwen2 | qwen3 | mistral)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama3":
        model_type = "llama"
        base.update(
            rope_theta=500000.0,
            tie_word_embeddings=False,
            num_key_value_heads=1,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    elif kind == "qwen2":
        model_type = "qwen2"
        base.update(rope_theta=1000000.0, num_key_value_heads=4, tie_word_embeddings=False)
    elif kind == "qwen3":  # QK-norm, and a head_dim that is not hidden_size / heads (as in Qwen3)
        model_type = "qwen3"
        base.update(rope_theta=1000000.0, head_dim=32)
    else:
        model_type = kind
    base.update(overrides)
    cfg = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init give peaked, varied logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        if kind == "qwen3":  # norm weights away from 1, so q_norm and k_norm cannot be swapped unseen
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists():
            shutil.copy(src, path / name)
    return path


def make_lora_adapter(
    path: Path,
    base_dir: Path,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    rslora: bool = False,
    std: float = 0.2,
) -> Path:
    """A PEFT LoRA adapter of the HF model in `base_dir`, saved to `path`: random, non-zero A
    and B (PEFT's `init_lora_weights=False`, then normal weights of `std` so that each adapter
    visibly moves the base's tokens). Nothing downloaded."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def lora_factory() -> Any:
    """`make_lora_adapter` for tests (a fixture: test modules do not import conftest)."""
    return make_lora_adapter


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm_dir, "llama")


#: gpt-oss's harmony markers, special tokens of its tokenizer (server/chat/styles/harmony.py)
HARMONY_SPECIALS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
#: a chat template of gpt-oss's shape: a system message naming the channels, the tools as a
#: developer message, calls as commentary messages to functions.NAME, results from them
HARMONY_TEMPLATE = """<|start|>system<|message|>You are a tiny model.
Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

namespace functions {
{%- for t in tools %}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'system' %}<|start|>developer<|message|># Instructions\n\n{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary \
to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


@pytest.fixture(scope="session")
def tiny_harmony_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny Llama's directory with a gpt-oss-shaped tokenizer: SmolLM2's vocabulary, the
    harmony markers as special tokens (49152..), `<|return|>` its end, HARMONY_TEMPLATE."""
    import json

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-harmony")
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIALS)})
    tok.eos_token = "<|return|>"
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"], cfg["eos_token_id"] = len(tok), tok.convert_tokens_to_ids("<|return|>")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), smollm_dir, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), smollm_dir, "qwen3")


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama3"), smollm_dir, "llama3")


@pytest.fixture(scope="session")
def tiny_window_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> dict[str, Path]:
    """Sliding windows of 20 tokens: a Qwen2 whose three layers are windowed, full and windowed
    (`use_sliding_window` with `layer_types`, Gemma 3's kind of mix), and a Mistral windowed
    on every layer."""
    sliding, full = "sliding_attention", "full_attention"
    qwen2 = make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2-window"),
        smollm_dir,
        "qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=20,
        layer_types=[sliding, full, sliding],
    )
    mistral = make_tiny_model(
        tmp_path_factory.mktemp("tiny-mistral"), smollm_dir, "mistral", sliding_window=20
    )
    return {"qwen2": qwen2, "mistral": mistral}


# llama.cpp's formats for a tiny GGUF: the attention and gate/up parts in Q4_0 but
# attn_v and ffn_down in Q8_0 (as a Q4_K_M file mixes Q4_K and Q6_K), the embedding Q8_0.
TINY_GGUF_FORMATS = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
}


@functools.cache
def _tokenizer_fields(tokenizer_gguf: str) -> dict[str, Any]:
    """A GGUF's tokenizer metadata, read once (gguf's reader takes seconds over 49k tokens)."""
    import gguf

    f = gguf.GGUFReader(tokenizer_gguf).fields
    names = ("model", "pre", "tokens", "token_type", "merges")
    return {n: f[f"tokenizer.ggml.{n}"].contents() for n in names} | {
        "chat_template": f["tokenizer.chat_template"].contents()
    }


def make_tiny_gguf(
    path: Path, hf_dir: Path, tokenizer_gguf: Path, change: Any = None, quantized: bool = True
) -> Path:
    """Write the Llama in `hf_dir` as llama.cpp writes a GGUF: its names, Q and K rows
    permuted for llama.cpp's rotary, linear weights quantized (TINY_GGUF_FORMATS), norms
    F32, and the tokenizer metadata copied from `tokenizer_gguf` (the same vocabulary).
    `change(gguf name, fp32 array)`, when given, returns what to write instead, or None
    to leave the tensor out (a file that disagrees with its config, for the checks);
    `quantized` False writes every tensor F32 (seconds faster)."""
    import json

    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    f = _tokenizer_fields(str(tokenizer_gguf))
    w.add_tokenizer_model(f["model"])
    w.add_tokenizer_pre(f["pre"])
    w.add_token_list(f["tokens"])
    w.add_token_types(f["token_type"])
    w.add_token_merges(f["merges"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(f["chat_template"])

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        x = t.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            short = names[parts[-2]]
            gname = f"blk.{parts[1]}.{short}.weight"
        else:
            short = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[parts[0]]
            gname = f"{short}.weight"
        if short in ("attn_q", "attn_k"):
            x = permute(x, heads if short == "attn_q" else kv_heads)
        if change is not None and (x := change(gname, x)) is None:
            continue  # left out of the file
        qtype = TINY_GGUF_FORMATS.get(short) if quantized else None
        if qtype is None:
            w.add_tensor(gname, x)
        else:
            w.add_tensor(gname, gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf_source(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """The HF directory `tiny_gguf_path` is written from (make_tiny_gguf's `hf_dir`)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-for-gguf"), smollm_dir, "llama")


@pytest.fixture(scope="session")
def tiny_gguf_like(tiny_gguf_source: Path) -> Any:
    """`like(path, change)`: the tiny GGUF written to `path` with make_tiny_gguf's `change`
    (its tensors F32: what is checked is their shapes)."""
    from wsllm.models.loader import default_gguf_path

    return lambda path, change: make_tiny_gguf(path, tiny_gguf_source, default_gguf_path(), change, False)


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory: pytest.TempPathFactory, tiny_gguf_source: Path) -> Path:
    """The tiny Llama (tiny_model_dir's weights) as a quantized GGUF, served in its blocks
    by default. Converted in a cache of its own, so every session reads it afresh."""
    from wsllm.models.loader import default_gguf_path

    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.Q4_0.gguf"
    return make_tiny_gguf(path, tiny_gguf_source, default_gguf_path())


def make_word_tokenizer(path: Path, n_words: int = 509, specials: tuple[str, ...] = ()) -> Path:
    """A tokenizer of its own vocabulary (none of SmolLM2's): whole words `w0`..`wN`
    and three specials, with a chat template. For a second model behind one gateway.
    `specials` are added after the words (ids from n_words + 3), e.g. FIM tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(n_words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": list(specials)})
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}w0"
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_words_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with `make_word_tokenizer`'s 512-token vocabulary."""
    words = make_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"))
    return make_tiny_model(tmp_path_factory.mktemp("tiny-words"), words, "llama", vocab_size=512)


#: Qwen2.5-Coder's fill-in-the-middle tokens, in its FIM order (server/fim.py)
QWEN_FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="session")
def tiny_fim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama whose word-level tokenizer has Qwen2.5-Coder's FIM
    tokens (ids 509, 510, 511 of its 512)."""
    words = make_word_tokenizer(tmp_path_factory.mktemp("fim-tokenizer"), 506, QWEN_FIM)
    return make_tiny_model(tmp_path_factory.mktemp("tiny-fim"), words, "llama", vocab_size=512)


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`word_tokenizer(specials)`: a `make_word_tokenizer` directory with `specials` added."""
    return lambda specials: make_word_tokenizer(tmp_path_factory.mktemp("words"), 506, tuple(specials))


@pytest.fixture(scope="session")
def smollm_llm(smollm_dir: Path) -> Any:
    """One SmolLM2 LLM per session (loading is the slow part)."""
    from wsllm import LLM

    # HF parity is exact in fp32, the KV cache's included (auto would pick float16 here)
    return LLM(model=str(smollm_dir), max_num_seqs=32, dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="session")
def smollm_hf(smollm_dir: Path) -> Any:
    """The Hugging Face transformers model: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()


class RedisServer:
    """A real `redis-server` on a free port with its own temp dir, no persistence.
    `stop()` and `start()` restart it on the same port (an outage, and a Redis that
    comes back empty)."""

    def __init__(self, workdir: Path) -> None:
        import socket

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail(
                "redis-server is not installed: `make test` installs it "
                "(or: sudo apt-get install -y redis-server)",
                pytrace=False,
            )
        self.exe = exe
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Any = None

    def start(self, timeout: float = 10.0) -> None:
        import subprocess
        import time

        import redis

        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]  # fmt: skip
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert self.proc.poll() is None, f"redis-server exited; see {self.workdir / 'redis.log'}"
                assert time.monotonic() < deadline, "redis-server did not answer PING"
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's redis-server (started on first use, stopped at the end)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's 3-master Redis Cluster (tests/integration/redis_fixtures.py),
    started on first use; its `url` is a `redis+cluster://` one."""
    sys.path.insert(0, str(Path(__file__).parent / "integration"))
    from redis_fixtures import RedisClusterServer

    server = RedisClusterServer(tmp_path_factory.mktemp("redis-cluster"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["one", "cluster"])
def any_redis(request: pytest.FixtureRequest) -> Any:
    """The session's redis-server, then its Redis Cluster: a test that takes this runs
    on both."""
    return request.getfixturevalue("redis_server" if request.param == "one" else "redis_cluster")


# -- mixtures of experts: tiny random-weight models of each MoE family, and their GGUFs -------------

#: each family's tiny model: an odd number of experts, top-k >= 2, untied embeddings (a tied
#: table makes a tiny model repeat its last token), 2048 tokens (the first of SmolLM2's)
MOE_KINDS: dict[str, dict[str, Any]] = {
    "olmoe": dict(num_experts=5, num_experts_per_tok=2),
    "qwen3_moe": dict(
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=32,
        mlp_only_layers=[0],
    ),
    "mixtral": dict(num_local_experts=5, num_experts_per_tok=2),
    "granitemoeshared": dict(
        num_local_experts=5,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        embedding_multiplier=1.5,
        residual_multiplier=0.7,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    ),
}
MOE_VOCAB = 2048


def make_tiny_moe_model(path: Path, tokenizer_dir: Path, kind: str) -> Path:
    """A tiny random-weight mixture of experts of `kind` (MOE_KINDS), saved by transformers."""
    over = dict(vocab_size=MOE_VOCAB, hidden_size=64, intermediate_size=64, tie_word_embeddings=False)
    return make_tiny_model(path, tokenizer_dir, kind, **over, **MOE_KINDS[kind])


# GGUF architecture, whether llama.cpp permutes its Q/K rows
_MOE_GGUF_ARCH = {
    "olmoe": ("olmoe", False),
    "qwen3_moe": ("qwen3moe", False),
    "mixtral": ("llama", True),
    "granitemoeshared": ("granitemoe", True),
}
# the formats of a tiny MoE GGUF: both Q4_0 and Q8_0 in every file, experts included
MOE_GGUF_FORMATS = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q8_0",
    "ffn_gate_exps": "Q4_0",
    "ffn_up_exps": "Q4_0",
    "ffn_gate_up_exps": "Q4_0",
    "ffn_down_exps": "Q8_0",
    "ffn_gate_shexp": "Q8_0",
    "ffn_up_shexp": "Q8_0",
    "ffn_down_shexp": "Q4_0",
    "token_embd": "Q8_0",
    "output": "Q8_0",
}


def _moe_tensors(kind: str, state: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The HF tensors of a tiny MoE as llama.cpp names them (numpy fp32, row order): experts
    stacked [E, rows, cols]; Granite's fused gate_up kept fused (ffn_gate_up_exps)."""
    import numpy as np

    arch, permuted = _MOE_GGUF_ARCH[kind]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(x: Any, n: int) -> Any:  # llama.cpp's convert_hf_to_gguf
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "q_norm": "attn_q_norm",
        "k_norm": "attn_k_norm",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
        "gate": "ffn_gate_inp",
        "layer": "ffn_gate_inp",
    }
    expert_names = {
        "gate_proj": "ffn_gate_exps",
        "w1": "ffn_gate_exps",
        "up_proj": "ffn_up_exps",
        "w3": "ffn_up_exps",
        "down_proj": "ffn_down_exps",
        "w2": "ffn_down_exps",
    }
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, Any]] = {}
    for name, t in state.items():
        x = t.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if parts[0] != "layers":
            out[
                {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[parts[0]]
                + ".weight"
            ] = x
            continue
        blk = f"blk.{parts[1]}."
        if "experts" in parts:  # layers.N.(mlp|block_sparse_moe).experts.E.<proj>.weight
            e = int(parts[parts.index("experts") + 1])
            experts.setdefault(blk + expert_names[parts[-2]], {})[e] = x
        elif parts[-2] == "input_linear":  # Granite: [E, 2I, H] experts, or the shared expert's [2S, H]
            if parts[2] == "shared_mlp":
                g, u = np.split(x, 2)
                out[blk + "ffn_gate_shexp.weight"], out[blk + "ffn_up_shexp.weight"] = g, u
            else:
                out[blk + "ffn_gate_up_exps.weight"] = x
        elif parts[-2] == "output_linear":
            out[blk + ("ffn_down_shexp.weight" if parts[2] == "shared_mlp" else "ffn_down_exps.weight")] = x
        else:
            short = names[parts[-2]]
            if permuted and short in ("attn_q", "attn_k"):
                x = permute(x, heads if short == "attn_q" else kv_heads)
            out[f"{blk}{short}.weight"] = x
    for gname, per in experts.items():
        out[gname + ".weight"] = np.stack([per[e] for e in sorted(per)])
    return out


def make_tiny_moe_gguf(path: Path, hf_dir: Path, kind: str, tokenizer_gguf: Path, change: Any = None) -> Path:
    """The tiny MoE in `hf_dir` as llama.cpp writes its GGUF: its names and metadata, Q/K rows
    permuted where llama.cpp permutes them, linear weights and experts in MOE_GGUF_FORMATS, the
    router and norms F32, the first MOE_VOCAB tokens of SmolLM2's tokenizer. `change(name, fp32
    array)` returns what to write instead, or None to leave the tensor out; it may also set
    metadata: `change("(metadata)", writer)`."""
    import json

    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch, _ = _MOE_GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if "norm_topk_prob" in cfg:
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if cfg.get("mlp_only_layers"):
        w.add_leading_dense_block_count(len(cfg["mlp_only_layers"]))
    if kind == "granitemoeshared":
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    _add_tokenizer(w, tokenizer_gguf, cfg["vocab_size"])
    if change is not None:
        change("(metadata)", w)
    for name, x in _moe_tensors(kind, load_file(str(hf_dir / "model.safetensors")), cfg).items():
        if change is not None and (x := change(name, x)) is None:
            continue
        qtype = MOE_GGUF_FORMATS.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0])
        if qtype is None:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w: Any, tokenizer_gguf: Path, vocab: int) -> None:
    """The first `vocab` tokens of the GGUF's tokenizer, with the merges among them."""
    f = _tokenizer_fields(str(tokenizer_gguf))
    tokens = list(f["tokens"][:vocab])
    known = set(tokens)
    merges = [
        m for m in f["merges"] if (p := m.split(" ")) and len(p) == 2 and {p[0], p[1], p[0] + p[1]} <= known
    ]
    w.add_tokenizer_model(f["model"])
    w.add_tokenizer_pre(f["pre"])
    w.add_token_list(tokens)
    w.add_token_types(list(f["token_type"][:vocab]))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(f["chat_template"])


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Any:
    """`tiny_moe(kind)`: the kind's tiny MoE HF directory, made once a session."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_tiny_moe_model(tmp_path_factory.mktemp(f"tiny-{kind}"), smollm_dir, kind)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_moe_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Any) -> Any:
    """`tiny_moe_gguf(kind)`: the kind's tiny MoE as a GGUF (MOE_GGUF_FORMATS), made once a session."""
    from wsllm.models.loader import default_gguf_path

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            path = tmp_path_factory.mktemp(f"tiny-{kind}-gguf") / f"tiny-{kind}.gguf"
            made[kind] = make_tiny_moe_gguf(path, tiny_moe(kind), kind, default_gguf_path())
        return made[kind]

    return get


@pytest.fixture(scope="session")
def moe_gguf_like(tiny_moe: Any) -> Any:
    """`like(path, kind, change)`: a kind's tiny MoE GGUF with make_tiny_moe_gguf's `change`."""
    from wsllm.models.loader import default_gguf_path

    return lambda path, kind, change: make_tiny_moe_gguf(
        path, tiny_moe(kind), kind, default_gguf_path(), change
    )


# -- gpt-oss: a tiny random-weight GptOss built by transformers, its GGUF, its harmony twin --------

#: the tiny gpt-oss: 2 layers (layer 0 windowed to 8 tokens, shorter than the tests' prompts),
#: 5 experts, top 2, YaRN rotary (GptOssConfig's default), a swiglu limit low enough to clamp
GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=5,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    swiglu_limit=0.6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_gpt_oss(path: Path, tokenizer_dir: Path, vocab: int, **overrides: Any) -> Path:
    """A tiny random-weight GptOssForCausalLM saved by transformers, with `tokenizer_dir`'s tokenizer:
    every bias and the sinks non-zero (the sinks 0.5..2, large against the tiny model's logits)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=vocab, **(GPT_OSS | overrides))
    torch.manual_seed(1234)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.uniform_(0.5, 2.0)
            elif name.endswith("bias"):  # q, k, v, o, the router's, the experts' [E, 2I] and [E, H]
                p.normal_(0, 0.1)
            elif p.dim() > 1:
                p.normal_(0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


# the tiny gpt-oss GGUF's formats: the experts MXFP4 (as released), the rest Q4_0 and Q8_0
GPT_OSS_GGUF_FORMATS = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate_exps": "MXFP4",
    "ffn_up_exps": "MXFP4",
    "ffn_down_exps": "MXFP4",
    "token_embd": "Q8_0",
    "output": "Q8_0",
}
_GPT_OSS_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "router": "ffn_gate_inp",
}


def _gpt_oss_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The HF tensors of a tiny gpt-oss as llama.cpp's converter names and lays them out (numpy
    fp32, row order): the experts' interleaved gate_up split into gate and up, each [E, I, H]."""
    out: dict[str, Any] = {}
    glob = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    for name, t in state.items():
        x = t.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if parts[0] != "layers":
            out[glob[parts[0]] + ".weight"] = x
            continue
        blk, leaf = f"blk.{parts[1]}.", parts[-1]
        if leaf == "sinks":
            out[blk + "attn_sinks.weight"] = x
        elif leaf in ("gate_up_proj", "gate_up_proj_bias"):  # [E, H, 2I] / [E, 2I]: column 2j gate j
            kind = "weight" if leaf == "gate_up_proj" else "bias"
            g, u = x[..., 0::2], x[..., 1::2]
            if kind == "weight":
                g, u = g.transpose(0, 2, 1), u.transpose(0, 2, 1)
            out[f"{blk}ffn_gate_exps.{kind}"], out[f"{blk}ffn_up_exps.{kind}"] = g.copy(), u.copy()
        elif leaf == "down_proj":
            out[blk + "ffn_down_exps.weight"] = x.transpose(0, 2, 1).copy()
        elif leaf == "down_proj_bias":
            out[blk + "ffn_down_exps.bias"] = x
        else:
            out[f"{blk}{_GPT_OSS_NAMES[parts[-2]]}.{leaf}"] = x
    return out


def make_tiny_gpt_oss_gguf(path: Path, hf_dir: Path, tokenizer_gguf: Path) -> Path:
    """The tiny gpt-oss in `hf_dir` as llama.cpp writes its GGUF ("gpt-oss"; GPT_OSS_GGUF_FORMATS)."""
    import json

    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_swiglu_clamp_exp([cfg["swiglu_limit"]] * cfg["num_hidden_layers"])  # the tiny one's clamp
    _add_tokenizer(w, tokenizer_gguf, cfg["vocab_size"])
    for name, x in _gpt_oss_tensors(load_file(str(hf_dir / "model.safetensors"))).items():
        base = name.rsplit(".", 1)
        qtype = GPT_OSS_GGUF_FORMATS.get(base[0].split(".")[-1]) if base[1] == "weight" else None
        if qtype is None:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """The tiny gpt-oss's HF directory (the first MOE_VOCAB tokens of SmolLM2's tokenizer)."""
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"), smollm_dir, MOE_VOCAB)


@pytest.fixture(scope="session")
def tiny_gpt_oss_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_gpt_oss: Path) -> Path:
    from wsllm.models.loader import default_gguf_path

    path = tmp_path_factory.mktemp("tiny-gpt-oss-gguf") / "tiny-gpt-oss.gguf"
    return make_tiny_gpt_oss_gguf(path, tiny_gpt_oss, default_gguf_path())


@pytest.fixture(scope="session")
def tiny_gpt_oss_harmony(tmp_path_factory: pytest.TempPathFactory, tiny_harmony_dir: Path) -> Path:
    """A tiny gpt-oss with tiny_harmony_dir's tokenizer (harmony's markers special tokens,
    `<|return|>` its end, a chat template of gpt-oss's shape)."""
    import json

    cfg = json.loads((tiny_harmony_dir / "config.json").read_text())
    path = tmp_path_factory.mktemp("tiny-gpt-oss-harmony")
    return make_tiny_gpt_oss(
        path, tiny_harmony_dir, cfg["vocab_size"], eos_token_id=cfg["eos_token_id"], pad_token_id=0
    )


@pytest.fixture(scope="session")
def gguf_tokenizer() -> Any:
    """`add(writer, vocab)`: the first `vocab` tokens of SmolLM2's tokenizer (its merges among
    them, its chat template) into a GGUF being written, for a test's own GGUF writer."""
    from wsllm.models.loader import default_gguf_path

    return lambda w, vocab: _add_tokenizer(w, default_gguf_path(), vocab)


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A tiny random-weight SmolVLM that sees (tests/tiny_vlm.py)."""
    from tiny_vlm import make_tiny_smolvlm

    return make_tiny_smolvlm(tmp_path_factory.mktemp("tiny-smolvlm"), smollm_dir)
