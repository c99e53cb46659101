"""What is alive once a server has loaded lives as long as it does: a full garbage collection
that walks it finds nothing and holds the GIL throughout (260-340 ms in the amplification
bench, every stream of the engine stopped: docs/benchmarks.md, "Amplification"). So the app
freezes it when it starts serving, and hands it back to the collector when it shuts down (an
app made and closed inside a longer-lived process, as here)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import httpx

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app


def test_the_loaded_heap_is_out_of_the_collectors_reach_while_serving(
    tiny_model_dir: Path, uvicorn_thread: Any
) -> None:
    broker = MemoryBroker()
    broker.heartbeat(EngineInfo("e1", "tiny", 2048))
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), GatewayConfig()) as (
        base,
        _,
    ):
        assert httpx.get(f"{base}/health").status_code == 200
        frozen = gc.get_freeze_count()
        walked = len(gc.get_objects())  # what a full collection would walk now
        assert frozen > 10_000, f"only {frozen} objects frozen at start"
        assert walked < frozen / 4, f"a full collection walks {walked} objects beside {frozen} frozen"
    assert gc.get_freeze_count() == 0, "a closed app leaves its objects frozen (never collected)"
