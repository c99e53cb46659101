"""bench/families.py's files, without serving them: the real shapes' metadata (Gemma-3-4B's, gpt-oss-20b's
layers) read by wsllm's GGUF loader give the config each family is (windows, rotary bases, the q.k scale,
experts), and their tensor lists pass its shape checks; the tiny shapes' files (the smoke's) plan with
their linear layers in Q4_0 and the experts in MXFP4; `--check` loads its tiny files in wsllm, samples
greedy and at temperature 0.7 / top_p 0.9, and holds less KV than full attention past the windows;
llama-server's KV caches are read from its log; the docs section has a row per server and setting."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the bench imports its siblings
fs = importlib.import_module("family_shapes")
families = importlib.import_module("families")
families_long = importlib.import_module("families_long")


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files without SmolLM2's tokenizer (parsing its 49k tokens takes seconds): the loader's
    config and tensors need only the vocabulary's size, which the metadata says."""
    monkeypatch.setattr(fs.random_gguf, "add_tokenizer", lambda w, vocab: None)


def config_of(s: Any) -> Any:
    """The shape's ModelConfig as wsllm reads it from the keys bench/family_shapes.py writes."""
    import gguf

    from wsllm.models import registry

    w = gguf.GGUFWriter(None, s.arch)
    s.metadata(w)
    fields = {k: SimpleNamespace(contents=lambda v=v.value: v) for k, v in w.kv_data[0].items()}
    fields["general.architecture"] = SimpleNamespace(contents=lambda: s.arch)
    names = {name for name, _, _ in s.tensors()}
    return registry.model_config(registry.gguf_hf_config("(test)", fields, names))


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_the_real_shapes_read_as_their_family_and_pass_the_loaders_checks(name: str) -> None:
    from wsllm.models.gguf_checks import check_tensors

    s = fs.SHAPES[name]
    cfg = config_of(s)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim)  # fmt: skip
    windows = [cfg.layer(i).window for i in range(s.layers)]
    if name == "gemma3":  # 5 windowed to each full one, the 6th, 12th, ... full (HF's layer_types)
        assert [i for i, w in enumerate(windows) if w == 0] == [5, 11, 17, 23, 29]
        assert set(windows) == {0, 1024} and cfg.tie_word_embeddings and cfg.sandwich_norms
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4) and cfg.rope_scaling["factor"] == 8.0
        assert cfg.attention_scale == pytest.approx(256**-0.5) and cfg.hidden_act == "gelu_tanh"
    else:  # 128-token windows on the even layers, sinks, 32 experts top-4, YaRN
        assert windows == [128, 0] * 12 and cfg.attn_sinks and not cfg.tie_word_embeddings
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (32, 4, 2880)
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0
    sizes = [(n, shape, b := fs.random_gguf.nbytes(q, shape), b) for n, q, shape in s.tensors()]
    check_tensors("(test)", sizes, cfg)


def test_the_default_gpt_oss_layers_fit_8_gb_and_keep_the_windows_alternating() -> None:
    args = families.parse_args(["--no-write-docs"])
    s = families.shape_of("gpt-oss", args)
    assert s.layers % 2 == 0 and 7e9 < fs.file_bytes(s) < 8e9
    assert fs.file_bytes(fs.SHAPES["gemma3"]) == pytest.approx(2.19e9, rel=0.01)  # a 4B in Q4_0


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_the_tiny_files_plan_in_their_blocks(name: str, tmp_path: Path) -> None:
    from wsllm.models import gguf_plan, registry
    from wsllm.models.gguf_checks import open_reader

    s = fs.TINY[name]
    path = fs.write(tmp_path / f"{name}.gguf", s)
    reader = open_reader(path)
    cfg = registry.model_config(
        registry.gguf_hf_config(path, reader.fields, {t.name: t for t in reader.tensors})
    )
    plan = gguf_plan.plan(path, reader, cfg)
    if name == "gemma3":  # q, k, v, o, gate, up, down and the tied embedding
        assert plan.counts == {"Q4_0": 7 * s.layers + 1} and "lm_head" not in plan.linears
        assert "layers.0.ffn_post_norm.weight" in plan.floats
    else:  # q, k, v, o, the embedding and the output; gate, up and down of the experts
        assert plan.counts == {"Q4_0": 4 * s.layers + 2, "MXFP4": 3 * s.layers}
        assert plan.floats["layers.1.self_attn.sinks"].shape == (s.heads,)
        assert plan.floats["layers.1.mlp.gate_up_bias"].shape == (s.experts, 2 * s.expert_ff)


def test_llama_servers_kv_caches_are_read_from_its_log() -> None:
    log = """\
0.00.557.916 I llama_kv_cache_iswa: creating non-SWA KV cache, size = 16640 cells
0.00.557.966 I llama_kv_cache:        CPU KV buffer size =   325.00 MiB
0.00.558.019 I llama_kv_cache: size =  325.00 MiB ( 16640 cells,   5 layers,  1/1 seqs), K (f16):  162.50 MiB, V (f16):  162.50 MiB
0.00.558.022 I llama_kv_cache_iswa: creating     SWA KV cache, size = 1536 cells
0.00.559.196 I llama_kv_cache: size =  174.00 MiB (  1536 cells,  29 layers,  1/1 seqs), K (f16):   87.00 MiB, V (f16):   87.00 MiB
"""
    assert families_long.llama_kv(log) == {"non-SWA": (325 * 2**20, 16640), "SWA": (174 * 2**20, 1536)}


def test_the_check_loads_the_tiny_files_samples_and_holds_less_kv_than_full_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = families.parse_args(["--check", "--gguf-dir", str(tmp_path), "--wsllm-args=--dtype float32"])
    results = {r["shape"]: r for r in families.run_check(args)}  # SystemExit on a failure
    assert set(results) == {"gemma3", "gpt-oss"} and set(results["gemma3"]["tokens"]) == {
        "greedy",
        "t0.7-p0.9",
    }
    for r in results.values():
        assert r["prompt_tokens"] == 8 * fs.CHECK[r["shape"]].window
    # Gemma 3: one full layer of six, the others keep about their window: well under half of full attention
    assert results["gemma3"]["kv_held"] < 0.5 * results["gemma3"]["kv_full"]
    assert "gemma3-check-6l.gguf loads" in capsys.readouterr().out
    bad = dict(results["gemma3"], kv_held=results["gemma3"]["kv_full"])
    assert families.check_failures([bad], 8) == [
        f"gemma3: {bad['kv_full']} KV bytes held, full attention {bad['kv_full']}"
    ]


def test_the_docs_section_has_a_row_per_server_and_setting() -> None:
    args = families.parse_args(["--no-write-docs", "--concurrency", "1,32"])

    def run(tok_s: float) -> dict[str, float]:
        return {"output_throughput": tok_s}

    runs = {"greedy": {1: run(30.0), 32: run(300.0)}, "t0.7-p0.9": {1: run(24.0), 32: run(250.0)}}
    rows = [
        {"name": "wsllm", "runs": runs, "peak_mb": 3000.0},
        {
            "name": "llamacpp",
            "runs": {k: {c: run(10.0) for c in v} for k, v in runs.items()},
            "peak_mb": 6000.0,
        },
    ]
    table = families.rows_text(fs.SHAPES["gemma3"], 2.0, rows, args.levels, args.samplings)
    assert "| **wsllm / llama-server** | greedy |  | **3.00x** | **30.00x** | **0.50x** |" in table
    assert "| **wsllm / llama-server** | t0.7-p0.9 |  | **2.40x** | **25.00x** | **0.50x** |" in table
    text = families.section([table], [], None, args, "python bench/families.py")
    assert text.startswith(f"## {families.TITLE}\n") and "top_p 0.9" in text and "flags" in text
