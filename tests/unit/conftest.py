"""Fixtures shared by the engine's unit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

#: what the scheduler ran in each step that ran something: "request_id/choice" -> tokens
StepLog = list[dict[str, int]]


@pytest.fixture
def record_steps() -> Callable[[Any], StepLog]:
    """`record_steps(engine)` -> a list that grows by one entry per engine step that ran
    tokens, read from the real scheduler's output (prefill chunks, prefix hits, decodes)."""

    def record(engine: Any) -> StepLog:
        log: StepLog = []
        schedule = engine.scheduler.schedule

        def recording() -> Any:
            out = schedule()
            if out.scheduled:
                log.append({f"{s.request_id}/{s.index}": n for s, n in out.scheduled})
            return out

        engine.scheduler.schedule = recording
        return log

    return record
