"""bench/serving_peers.py's own logic, without any server: its section of docs/benchmarks.md, the
ratios and token counts in its table, and the prompts every server gets."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))  # serving_peers imports its siblings by name
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


report = _load("serving_report")
peers = _load("serving_peers")


def run(tok_s: float, ttft_ms: float, out_tokens: list[int], usage: bool = True) -> dict[str, Any]:
    """A level as `wsllm bench --json` writes it (the fields the table reads)."""
    return {
        "output_throughput": tok_s,
        "failed": 0,
        "usage_reported": usage,
        "ttft_ms": {"p50": ttft_ms},
        "requests": [{"ok": True, "output_tokens": n, "prompt_tokens": 40} for n in out_tokens],
    }


def rows() -> list[Any]:
    ws = report.Row("wsllm", "wsllm", 5.0, {"greedy": {1: run(20, 100, [64] * 4), 8: run(90, 300, [64] * 4)},
                                            "qwen": {1: run(18, 100, [64] * 4), 8: run(99, 300, [64] * 4)}}, 1, 1)  # fmt: skip
    vl = report.Row(
        "vllm", "vLLM", 150.0, {"greedy": {1: run(10, 200, [64] * 4), 8: run(120, 400, [64] * 4)}}, 1, 1
    )
    # a server that stopped at EOS despite ignore_eos and sent no usage
    lc = report.Row("llamacpp", "llama", 2.0, {"greedy": {1: run(40, 50, [64, 12]), 8: run(30, 60, [64], False)},
                                               "qwen": {1: run(9, 50, [64] * 4), 8: run(33, 60, [64] * 4)}}, 1, 1)  # fmt: skip
    return [ws, vl, lc]


def args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(
        **{
            "levels": [1, 8],
            "seed": 0,
            "num_requests": 4,
            "output_len": 64,
            "smoke": False,
            "samplings": ["greedy", "qwen"],
            **kw,
        }  # fmt: skip
    )


def test_section_replaces_only_itself_and_is_stable() -> None:
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert f"## {report.TITLE}" not in doc or doc.count(f"## {report.TITLE}\n") == 1
    first = report.section(rows(), args(smoke=True), "python bench/serving_peers.py --smoke", "2026-01-01")
    second = report.section(rows()[:2], args(), "python bench/serving_peers.py", "2026-01-02")
    once = report.replace_section(doc, report.TITLE, first)
    twice = report.replace_section(once, report.TITLE, second)
    assert once.count(f"## {report.TITLE}\n") == twice.count(f"## {report.TITLE}\n") == 1
    # (the section's own text: the earlier runs kept under their own heading have ratio rows)
    mine = re.compile(rf"^## {re.escape(report.TITLE)}\n.*?(?=^## |\Z)", re.S | re.M)
    own_once, own_twice = mine.search(once).group(0), mine.search(twice).group(0)  # type: ignore[union-attr]
    assert "Smoke run" in own_once and "Smoke run" not in own_twice and "2026-01-02" in own_twice
    assert (
        "| wsllm / vLLM |" not in own_once and "| wsllm / vLLM |" in own_twice
    )  # no ratios from a smoke run
    assert report.replace_section(twice, report.TITLE, second) == twice
    # every other section is untouched, byte for byte
    without = report.replace_section(twice, report.TITLE, "")
    for heading in [ln for ln in doc.splitlines() if ln.startswith("## ") and report.TITLE not in ln]:
        part = doc.split(heading, 1)[1].split("\n## ", 1)[0].rstrip("\n")
        assert part in without, heading


def test_section_in_the_middle_keeps_what_follows() -> None:
    doc = "# B\n\n## A\n\na\n\n## " + report.TITLE + "\n\nold\n\n## C\n\nc\n"
    new = report.replace_section(doc, report.TITLE, f"## {report.TITLE}\n\nnew")
    assert new == "# B\n\n## A\n\na\n\n## " + report.TITLE + "\n\nnew\n\n## C\n\nc\n"


def test_table_shows_ratios_and_unhonoured_ignore_eos() -> None:
    text = report.section(rows(), args(), "cmd", "2026-01-01")
    assert "| wsllm / vLLM | greedy | 2.00x | 0.75x | 0.50x |" in text  # 20/10, 90/120; TTFT 100/200
    assert "| wsllm / llama-server | greedy | 0.50x | 3.00x | 2.00x |" in text
    assert "| wsllm / llama-server | qwen | 2.00x | 3.00x | 2.00x |" in text  # 18/9, 99/33
    assert "wsllm / vLLM | qwen" not in text  # vLLM ran greedy only
    # what sampling costs each server against its own greedy run
    assert "| wsllm | qwen | 0.90x | 1.10x |" in text and "| llama | qwen | 0.23x | 1.10x |" in text
    assert "`qwen` (temperature 0.7, top_p 0.8, top_k 20)" in text
    lines: dict[str, str] = {}
    for ln in text.splitlines():  # the first line of a server: its greedy row of the main table
        if ln.startswith("| "):
            lines.setdefault(ln.split(" | ")[0], ln)
    assert " | 64 | 5.0 |" in lines["| wsllm"]  # every request ran its 64 tokens
    assert " | 12–64 (chunks; no usage) | 2.0 |" in lines["| llama"]
    assert "flags" in text and "```\ncmd\n```" in text


def test_prompts_are_fixed_distinct_and_shared_by_every_level(tmp_path: Path) -> None:
    a, b = peers.chat_prompts(96, seed=0), peers.chat_prompts(96, seed=0)
    assert a == b and a != peers.chat_prompts(96, seed=1)
    texts = [m[0]["content"] for m in a]
    assert len(set(texts)) == 96 and all(
        m[0]["role"] == "user" and t.endswith(("?", ".")) for m, t in zip(a, texts, strict=True)
    )
    ns = peers.parse_args(["--concurrency", "1,8,32", "--num-requests", "32"])
    assert ns.samplings == ["greedy", "t0.7-p0.9", "qwen"]  # every setting by default
    peers.write_prompts(ns, tmp_path, len(ns.samplings))
    files = [(tmp_path / f"prompts-{i}.jsonl").read_text().splitlines() for i in range(9)]
    assert [len(f) for f in files] == [32] * 9 and len(set(sum(files, []))) == 288  # no run shares a prompt
    assert peers.sampling_flags("qwen") == ["--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]


def test_llama_server_is_built_for_the_cpus_flags_and_never_with_amx() -> None:
    """The peer build names each ISA the CPU has and no more, with AMX off even where listed (a VM
    that lists amx_tile killed `-march=native`'s build with SIGILL)."""
    setup = _load("peers_setup")
    amx = setup.cpu_flags(
        "processor : 0\nflags\t\t: fpu avx avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8\n"
    )
    got = setup.isa_flags(amx)
    assert "-DGGML_NATIVE=OFF" in got and "-DGGML_AVX512=ON" in got and "-DGGML_AVX512_VNNI=ON" in got
    assert "-DGGML_AVX512_BF16=OFF" in got and "-DGGML_AMX_TILE=OFF" in got and "-DGGML_AMX_INT8=OFF" in got
    avx2_only = setup.isa_flags(setup.cpu_flags("flags : fpu avx avx2 fma f16c\n"))
    assert "-DGGML_AVX2=ON" in avx2_only and "-DGGML_AVX512=OFF" in avx2_only
    assert avx2_only != got
