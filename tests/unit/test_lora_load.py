"""Adapters refused at load with a message that says why (a base they do not fit, a rank over
`--max-lora-rank`, a missing file, unknown target modules, DoRA, a malformed file), at start and at run time, the
engine serving on with nothing held; and the grouped LoRA kernels: the native pass on every ISA
path and the Triton kernels (interpreter) equal the torch reference, and a row's native result
does not depend on the other rows of its batch."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from wsllm.kernels import lora as klora
from wsllm.kernels import quant
from wsllm.kernels.lora import LoraPiece

from wsllm import LLM, SamplingParams
from wsllm.config import EngineConfig
from wsllm.models.lora import AdapterError


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    allowed = str(tmp_path_factory.getbasetemp())  # every adapter these tests write
    return LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        kv_cache_gb=0.02,
        max_lora_rank=8,
        allow_adapter_dir=allowed,
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, lora_factory: Any) -> Path:
    return lora_factory(tmp_path_factory.mktemp("good") / "a", tiny_model_dir, 1, r=4)


def bad_adapters(
    root: Path, tiny_model_dir: Path, tiny_qwen2_dir: Path, good: Path, make: Any
) -> dict[str, tuple[Path, str]]:
    """name -> (adapter directory, what its refusal must say)."""
    missing = root / "missing"
    shutil.copytree(good, missing)
    (missing / "adapter_model.safetensors").unlink()
    return {
        "other-base": (make(root / "qwen", tiny_qwen2_dir, 2, r=4), "do not fit the base"),
        "rank": (make(root / "rank", tiny_model_dir, 3, r=16), "rank 16 is over --max-lora-rank 8"),
        "missing": (missing, "has no adapter_model.safetensors"),
        "nowhere": (root / "nowhere", "no adapter directory"),
        "lm-head": (
            make(root / "head", tiny_model_dir, 4, r=4, targets=("lm_head",)),
            "unknown target modules ['lm_head']",
        ),
        "dora": (_dora(root / "dora", tiny_model_dir), "DoRA (use_dora) is not supported"),
    }


def _dora(path: Path, base_dir: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)).save_pretrained(str(path))
    return path


def test_bad_adapters_are_refused_at_run_time_and_the_engine_serves_on(
    llm: LLM, good: Path, tmp_path: Path, tiny_model_dir: Path, tiny_qwen2_dir: Path, lora_factory: Any
) -> None:
    adapters = llm.engine.adapters
    for name, (path, why) in bad_adapters(
        tmp_path, tiny_model_dir, tiny_qwen2_dir, good, lora_factory
    ).items():
        with pytest.raises(AdapterError, match=re.escape(why)):
            adapters.load(name, str(path))
        assert name not in adapters.names()
    with pytest.raises(ValueError, match="not loaded on this engine"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora="rank")
    adapters.load("good", str(good))
    try:
        with pytest.raises(AdapterError, match="already loaded"):
            adapters.load("good", str(good))
        out = llm.generate([[5, 6, 7]] * 2, SamplingParams(temperature=0.0, max_tokens=4), lora=["good", ""])
        assert all(len(r.token_ids) == 4 for r in out)
    finally:
        adapters.unload("good")
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished()


def test_a_run_time_load_reads_only_below_the_allowed_directory(
    tiny_model_dir: Path, good: Path, tmp_path: Path
) -> None:
    """Without --allow-adapter-dir a run-time load is refused; with it, a path outside it
    (or a link that leads out of it) is refused too; --lora at start is read wherever."""
    from wsllm.engine.commands import apply_one
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import AdapterCommand

    def engine(allow: str | None) -> Any:
        c = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, max_num_seqs=1,
                         lora=[f"boot={good}"], allow_adapter_dir=allow)  # fmt: skip
        return LLMEngine.from_config(c)

    off = engine(None)
    assert off.adapters.names() == ["boot"]
    reply = apply_one(off, AdapterCommand("c1", "load", "x", str(good)), "e1")
    assert reply.status == 403 and "--allow-adapter-dir" in reply.error, reply
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(good, target_is_directory=True)  # leads out of it
    shutil.copytree(good, allowed / "inside")
    on = engine(str(allowed))
    for path in (good, allowed / "link", allowed / "inside" / ".." / ".." / good.name):
        reply = apply_one(on, AdapterCommand("c2", "load", "x", str(path)), "e1")
        assert reply.status == 403 and "not below --allow-adapter-dir" in reply.error, (path, reply)
    assert apply_one(on, AdapterCommand("c3", "load", "x", str(allowed / "inside")), "e1").status == 200
    assert sorted(on.adapters.names()) == ["boot", "x"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad-config"])
def test_a_malformed_adapter_file_is_a_clear_400_at_run_time(
    llm: LLM, good: Path, tmp_path: Path, damage: str
) -> None:
    """What the operator's load route answers (engine/commands.py): a file that is not
    what it says (not safetensors, cut short, a config that is not JSON) is the operator's
    400 naming the file, never a 500; the engine serves on."""
    from wsllm.engine.commands import apply_one
    from wsllm.types import AdapterCommand

    bad = tmp_path / damage
    shutil.copytree(good, bad)
    weights, config = bad / "adapter_model.safetensors", bad / "adapter_config.json"
    if damage == "garbage":
        weights.write_bytes(b"this is not a safetensors file" * 8)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        config.write_text("{not json")
    reply = apply_one(llm.engine, AdapterCommand("c1", "load", damage, str(bad)), "e1")
    assert reply.status == 400, reply
    assert ("safetensors" if damage != "bad-config" else "adapter_config.json") in reply.error
    assert damage not in llm.engine.adapters.names()


def test_a_bad_adapter_stops_the_start_and_bad_flags_are_refused(tiny_model_dir: Path, good: Path) -> None:
    from wsllm.engine.engine import LLMEngine

    with pytest.raises(AdapterError, match="rank 4 is over --max-lora-rank 2"):
        LLMEngine.from_config(
            EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, lora=[f"a={good}"], max_lora_rank=2)
        )
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(lora=["no-path"])
    # vLLM's --max-loras: how many are resident, not how many are served
    assert EngineConfig(lora=[f"a={good}", f"b={good}"], max_loras=1).max_loras == 1
    with pytest.raises(ValueError, match="more than --max-registered-loras 1"):
        EngineConfig(lora=[f"a={good}", f"b={good}"], max_registered_loras=1)


# -- the kernels ---------------------------------------------------------------------------


def case(
    dtype: torch.dtype, k: int = 100, seed: int = 0, weights: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """x [9, k], y [9, 70] and three groups: every row of one adapter (tiles of 4, 4 and 1), rows
    of two others (3 and 2: ranks 1, 5 and 16; two pieces side by side, a column tail past a whole
    vector)."""
    g = torch.Generator().manual_seed(seed)

    def piece(r: int, n: int, off: int) -> LoraPiece:
        a, bt = torch.randn(r, k, generator=g), torch.randn(r, n, generator=g) * 0.3
        return LoraPiece(a.to(weights), bt.to(weights), off)

    x = torch.randn(9, k, generator=g).to(dtype)
    y = torch.randn(9, 70, generator=g).to(dtype)
    groups = [
        ([piece(5, 30, 0), piece(16, 37, 30)], None),
        ([piece(1, 70, 0)], torch.tensor([0, 4, 8])),
        ([piece(16, 13, 57)], torch.tensor([7, 2])),
    ]
    return x, y, groups


def native(y: torch.Tensor, x: torch.Tensor, groups: list[Any]) -> None:
    from wsllm.kernels import cpu_ops

    handles = [klora.NativeLora(cpu_ops.native_ext(), {(0, 0): pieces}).handle for pieces, _ in groups]
    klora.lora_apply_cpu(y, x, 0, handles, [rows for _, rows in groups])


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", quant.ISAS)
def test_the_native_pass_on_every_isa_path_equals_the_reference(
    isa: str, dtype: torch.dtype, weights: torch.dtype
) -> None:
    try:
        quant.force_isa(isa)
    except RuntimeError:
        pytest.skip(f"the {isa} path cannot run here")
    try:
        x, y, groups = case(dtype, weights=weights)
        want = y.clone()
        klora.lora_apply_ref(want, x, groups)
        got = y.clone()
        native(got, x, groups)
        alone = y[4:5].clone()  # row 4 alone: the second group's row, and the first group's
        native(alone, x[4:5].contiguous(), [(groups[0][0], None), (groups[1][0], torch.tensor([0]))])
    finally:
        quant.force_isa(None)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype is torch.float32 else {"atol": 0.06, "rtol": 0.02}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(alone[0], got[4])  # the same bits with or without the rest of the batch
    assert not torch.equal(got, y)


def test_the_triton_kernels_equal_the_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    for seed in (0, 1):
        x, y, groups = case(torch.float32, k=64 + seed, seed=seed)
        want, got = y.clone(), y.clone()
        klora.lora_apply_ref(want, x, groups)
        klora.lora_apply_triton(got, x, groups)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_large_pass_runs_on_every_thread_and_keeps_each_rows_bits() -> None:
    """Rank 64 over SmolLM2's qkv: its pieces go to torch's threads (one row too), and a row's
    result is still the same alone and in a batch of 9, and equal to the reference."""
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here")
    g = torch.Generator().manual_seed(3)
    pieces = [
        LoraPiece(
            torch.randn(64, 576, generator=g).bfloat16(), torch.randn(64, n, generator=g).bfloat16(), off
        )
        for n, off in ((576, 0), (192, 576), (192, 768))
    ]
    x = torch.randn(9, 576, generator=g).bfloat16()
    y = torch.randn(9, 960, generator=g).bfloat16()
    batch, alone, want = y.clone(), y[3:4].clone(), y.clone()
    native(batch, x, [(pieces, None)])
    native(alone, x[3:4].contiguous(), [(pieces, None)])
    klora.lora_apply_ref(want, x, [(pieces, None)])
    assert torch.equal(alone[0], batch[3])
    torch.testing.assert_close(batch, want, atol=0.5, rtol=0.02)
