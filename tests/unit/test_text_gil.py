"""A long prompt tokenized on a thread must not stop the event loop (issue 23): the
tokenizer's `encode` and `decode` hold the GIL throughout (seconds for a megabyte),
its batch calls release it (`encode_batch_fast`: `encode_batch` takes it back to hand over
the offsets). The ids and the text are the same either way."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wsllm.server.text import TextCodec


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec(str(smollm_dir))


def worst_pause(work: Callable[[], Any]) -> tuple[float, float, Any]:
    """(the longest this thread waited to wake from 1 ms sleeps, how long `work` took
    on another thread, what it returned)."""
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(work()))
    worst, t0 = 0.0, time.perf_counter()
    th.start()
    last = t0
    while th.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst, time.perf_counter() - t0, out[0]


def test_a_long_prompt_is_tokenized_and_detokenized_without_holding_the_loop(codec: TextCodec) -> None:
    rng = random.Random(0)
    text = " ".join(
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9))) for _ in range(60000)
    )
    pause, took, ids = worst_pause(lambda: codec.encode(text))
    assert ids == list(codec.backend.encode(text).ids)
    assert pause < max(0.2, took / 3), f"the loop waited {pause:.2f}s of a {took:.2f}s encode"
    pause, took, back = worst_pause(lambda: codec.decode(ids))
    assert back == codec.backend.decode(ids, skip_special_tokens=False)
    assert pause < max(0.2, took / 3), f"the loop waited {pause:.2f}s of a {took:.2f}s decode"
