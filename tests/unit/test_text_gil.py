"""A long prompt tokenized on a thread must not stop the event loop (issue 23): the
tokenizer's `encode` and `decode` hold the GIL throughout (seconds for a megabyte),
its batch calls release it (`encode_batch_fast`: `encode_batch` takes it back to hand over
the offsets). The ids and the text are the same either way.

The test calibrates itself: it first measures the calls that hold the GIL on an input
long enough that the loop would wait a quarter of a second for them (the input doubles
until it does), then asks the codec's calls to keep the loop's worst wait under a
quarter of that. A codec that held the GIL (encode or decode) fails here; a floor of
its own would not (a GIL-holding decode of a short text took 29 ms, under any floor)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wsllm.server.text import TextCodec

HELD_S = 0.25  # the loop's wait for a call that holds the GIL, at least


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


def held_long_enough(call: Callable[[Any], Any], start: Any) -> tuple[Any, float]:
    """The input, doubled until `call` on it (holding the GIL) keeps the loop waiting
    HELD_S at least; and that wait."""
    x = start
    for _ in range(8):
        pause, took, _ = worst_pause(lambda x=x: call(x))
        assert pause > took / 2, "the GIL-holding call did not stop this thread: the test sees nothing"
        if pause >= HELD_S:
            return x, pause
        x = x + x
    raise AssertionError(f"a GIL-holding call never kept the loop waiting {HELD_S}s")


def test_a_long_prompt_is_tokenized_and_detokenized_without_holding_the_loop(codec: TextCodec) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9))) for _ in range(20000)]
    text, held = held_long_enough(lambda t: codec.backend.encode(t), " ".join(words) + " ")
    pause, took, ids = worst_pause(lambda: codec.encode(text))
    assert ids == list(codec.backend.encode(text).ids)
    assert pause < held / 4, (
        f"the loop waited {pause:.2f}s of a {took:.2f}s encode ({held:.2f}s holding the GIL)"
    )
    ids, held = held_long_enough(lambda i: codec.backend.decode(i, skip_special_tokens=False), ids)
    pause, took, back = worst_pause(lambda: codec.decode(ids))
    assert back == codec.backend.decode(ids, skip_special_tokens=False)
    assert pause < held / 4, (
        f"the loop waited {pause:.2f}s of a {took:.2f}s decode ({held:.2f}s holding the GIL)"
    )
