"""Block manager invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsllm.engine.block_manager import BlockManager, NoFreeBlocksError

ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "free", "fork", "cow"]),
        st.integers(0, 7),  # sequence id
        st.lists(st.integers(0, 5), min_size=1, max_size=60),  # tokens (small alphabet: prefix hits)
    ),
    max_size=80,
)


def run_ops(bm: BlockManager, seq_ops: list[tuple[str, int, list[int]]]) -> None:
    lengths: dict[int, list[int]] = {}
    for op, sid, toks in seq_ops:
        if op == "alloc" and sid not in lengths:
            if bm.can_allocate(toks):
                bm.allocate(sid, toks)
                lengths[sid] = list(toks)
                bm.register_computed(sid, toks, len(toks))
        elif op == "append" and sid in lengths:
            new = lengths[sid] + toks[:3]
            if bm.ensure_slots(sid, len(new)):
                bm.copy_on_write(sid, len(lengths[sid]))
                lengths[sid] = new
                bm.register_computed(sid, new, len(new))
        elif op == "fork" and sid in lengths:
            child = sid + 100
            if child not in lengths:
                bm.fork(sid, child)
                lengths[child] = list(lengths[sid])
        elif op == "cow" and sid in lengths:
            with contextlib.suppress(NoFreeBlocksError):
                bm.copy_on_write(sid, max(0, len(lengths[sid]) - 1))
        elif op == "free" and sid in lengths:
            bm.free(sid)
            del lengths[sid]
            bm.free(sid + 100) if sid + 100 in lengths else None
            lengths.pop(sid + 100, None)
        bm.check_invariants()
        for s, t in lengths.items():
            assert len(bm.block_tables[s]) * bm.block_size >= len(t)
    for s in list(lengths):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert all(c == 0 for c in bm.ref_counts)


@settings(max_examples=150, deadline=None)
@given(seq_ops=ops, caching=st.booleans(), num_blocks=st.integers(4, 40))
def test_no_leak_no_double_free_counts_match(seq_ops, caching, num_blocks) -> None:  # type: ignore[no-untyped-def]
    run_ops(BlockManager(num_blocks, 8, watermark=0.0, enable_prefix_caching=caching), seq_ops)


def test_double_free_is_detected() -> None:
    bm = BlockManager(4, 8)
    bm.allocate(1, [1, 2, 3])
    b = bm.block_tables[1][0]
    bm.free(1)
    with pytest.raises(AssertionError, match="double free"):
        bm._release(b)


def test_watermark_keeps_blocks_for_decodes() -> None:
    bm = BlockManager(100, 8, watermark=0.1)
    assert bm.can_allocate(list(range(8 * 90)))
    assert not bm.can_allocate(list(range(8 * 91)))


def test_prefix_hit_reuses_blocks_and_counts() -> None:
    bm = BlockManager(16, 8, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(40))
    assert bm.allocate(1, prompt) == 0
    bm.register_computed(1, prompt, 40)
    bm.free(1)  # blocks stay cached (evictable)
    assert bm.allocate(2, prompt + [7, 7]) == 40
    assert bm.block_tables[2][:5] == list(range(5))
    bm.check_invariants()
