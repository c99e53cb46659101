"""bench/moe.py's pieces, without measuring anything: a tiny shape's random Q4_0 GGUF (written as the
bench writes OLMoE's and Qwen3-30B-A3B's) loads in wsllm with its experts in their blocks and produces
tokens; the bytes a token reads follow from the shapes; llama-server's command line (bench/random_gguf.py
makes it) is the one that bench/peers_setup.py builds; the docs section carries the table, the goals and
the CPU's flags."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))  # the bench imports its siblings by name
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


moe = _load("moe")


def test_a_tiny_shapes_gguf_loads_in_its_blocks_and_produces_tokens(tmp_path: Path) -> None:
    from wsllm.kernels import quant

    from wsllm import LLM, SamplingParams
    from wsllm.models.quant_linear import QuantExpertsModule

    tiny = replace(moe.SHAPES["qwen3moe"], vocab=49152, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                   experts=5, top_k=2, expert_ff=64, ctx=512)  # fmt: skip
    path = moe.write_gguf(tmp_path / "tiny.Q4_0.gguf", tiny)
    llm = LLM(model=str(path), dtype="float32", kv_cache_gb=0.05)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantExpertsModule)]
    if quant.native_status()[0]:
        assert len(experts) == 2 and experts[0].qexperts.gate.qtype == "Q4_0"
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6


def test_the_bytes_a_token_reads_follow_from_the_shapes() -> None:
    olmoe = moe.SHAPES["olmoe"]
    per_token = moe.weight_bytes_per_token(olmoe)
    experts = olmoe.layers * olmoe.top_k * 3 * moe.q4_0_bytes(olmoe.expert_ff, olmoe.hidden)
    output = moe.q4_0_bytes(olmoe.vocab, olmoe.hidden)
    assert experts + output < per_token < experts + output + 16 * 60e6  # + attention and routers
    more = replace(olmoe, top_k=olmoe.top_k + 1)
    assert moe.weight_bytes_per_token(more) - per_token == olmoe.layers * 3 * moe.q4_0_bytes(
        olmoe.expert_ff, olmoe.hidden
    )


def test_llama_server_runs_the_peer_build_on_the_same_file(tmp_path: Path) -> None:
    peers, shared = sys.modules["peers_setup"], sys.modules["random_gguf"]
    args = argparse.Namespace(levels=[1, 8, 32], ctx=8192, threads=2, llama_args="-lm none", wsllm_args="",
                              peers_dir=tmp_path)  # fmt: skip
    with pytest.raises(SystemExit, match="peers_setup.py"):  # not built in tmp_path
        shared.server_argv("llamacpp", tmp_path / "x.gguf", 8080, args)
    binary = peers.llama_server_path(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.touch()
    argv = shared.server_argv("llamacpp", tmp_path / "x.gguf", 8080, args)
    assert argv[:3] == [str(binary), "-m", str(tmp_path / "x.gguf")] and argv[-2:] == ["-lm", "none"]
    assert "-np" in argv and argv[argv.index("-np") + 1] == "32"
    ws = shared.server_argv("wsllm", tmp_path / "x.gguf", 8080, args)
    assert ws[1:4] == ["serve", "--model", str(tmp_path / "x.gguf")]


def test_the_docs_section_carries_the_table_the_goals_and_the_flags() -> None:
    args = argparse.Namespace(levels=[1, 8, 32], num_requests=32, output_len=64, ctx=8192)
    shape = moe.SHAPES["olmoe"]

    def run(tok_s: float) -> dict[str, float]:
        return {"output_throughput": tok_s}

    rows = [
        {
            "name": "wsllm",
            "runs": {"greedy": {1: run(40.0), 8: run(90.0), 32: run(150.0)}},
            "peak_mb": 4000.0,
        },
        {
            "name": "llamacpp",
            "runs": {"greedy": {1: run(30.0), 8: run(40.0), 32: run(42.0)}},
            "peak_mb": 9700.0,
        },
    ]
    table = moe.rows_text(shape, 3.6, rows, args.levels, 31.0)
    assert "**1.33x** | **2.25x** | **3.57x**" in table
    text = moe.section([table], args, "python bench/moe.py", 31.0)
    assert text.startswith(f"## {moe.TITLE}\n") and "31.0 GB/s" in text and "flags" in text
    bw = moe.weight_bytes_per_token(shape) * 40.0 / 1e9
    assert f"{bw:.1f} GB/s ({bw / 31.0:.0%})" in table
