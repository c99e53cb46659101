"""The gateway's heavy text work: CPU work that one request can make large (tokenizing a
long text, validating a large body, rendering a prompt-logprobs table, serializing an
answer of megabytes) runs here, off the event loop, on `text_work_threads` threads at
most and `text_work_nice` below the server's CPU priority.

Why a pool of its own and not `asyncio.to_thread`: the default executor runs as many of
these at once as it has threads (cores + 4), and in `wsllm serve` the engine steps in the
same process on every core with a team of threads that wait for each other at every
operator. One busy core slows a step by far more than a core's share: a team member
that lost its core holds the others at each barrier (on a busy 2-core machine, steps of
16 decodes: median 19 ms and worst 1.2 s with 2 torch threads, worst 60 ms with 1). Bounded here,
and niced so that the engine's threads take the cores first, a flood of such requests
queues behind itself instead of stalling every stream. Small inputs stay inline
(each caller's threshold); tokenizers and orjson release the GIL or finish in
milliseconds, so the loop is not held meanwhile.

`configure` (from `create_app`) sets the limits; `run(fn, *args)` awaits one job.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from wsllm.priority import lower_priority

T = TypeVar("T")

_settings: tuple[int, int] = (1, 10)  # (threads, nice): GatewayConfig's defaults
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def configure(threads: int, nice: int) -> None:
    """The pool's size and CPU priority (below the server's by `nice`); a change starts
    a new pool, the old one finishing what it has."""
    global _settings, _pool
    if threads < 1 or nice < 0:
        raise ValueError(f"text work needs threads >= 1 and nice >= 0, got {threads} and {nice}")
    with _lock:
        if (threads, nice) == _settings:
            return
        old, _pool, _settings = _pool, None, (threads, nice)
    if old is not None:
        old.shutdown(wait=False)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            threads, nice = _settings
            _pool = ThreadPoolExecutor(
                threads,
                thread_name_prefix="wsllm-text",
                initializer=lower_priority,
                initargs=(nice, "text work"),
            )
        return _pool


async def run(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the text-work pool, awaited without holding the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(fn, *args))
