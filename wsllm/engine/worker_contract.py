"""What the engine worker (worker.py) uses of the two objects it joins, declared as
Protocols so that it imports neither: `Engine`, the part of `LLMEngine` (and of the
fake engine) it drives, and `BrokerSide`, the engine's side of a broker. The broker
package declares the same calls (`broker.base.EngineBroker`, whose docstrings say what
each promises); every broker satisfies `BrokerSide` without the engine importing the
broker (tests/unit/test_broker_contract.py checks it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from wsllm.engine.outputs import EngineStats
from wsllm.types import EngineInfo, GenerateRequest, SamplingParams, TokenEvent


class Engine(Protocol):
    """The part of LLMEngine the worker uses."""

    model_name: str
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        cache_root: bytes | None = None,
        lora: str = "",
    ) -> None: ...
    def admission_rank(self) -> Callable[[int, str], tuple[int, float]]: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[Any]: ...
    def has_unfinished(self) -> bool: ...
    def free_capacity(self) -> int: ...
    def stats(self) -> EngineStats: ...


class BrokerSide(Protocol):
    """The engine's side of a broker, as the worker uses it."""

    def pull(
        self, max_n: int, timeout: float = 0.0, rank: Callable[[GenerateRequest], Any] | None = None
    ) -> list[GenerateRequest]: ...
    def aborts(self) -> list[str]: ...
    def publish(self, events: list[TokenEvent]) -> None: ...
    def heartbeat(self, info: EngineInfo) -> None: ...
    def deregister(self, engine_id: str) -> None: ...
    def dead_letter(self, item: object, reason: str) -> None: ...
    def release(self, request_ids: list[str], stalled: bool = False) -> list[str]: ...
