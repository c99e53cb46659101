"""The worker's intake (`Intake.admit`): the requests a broker delivered, into the
engine. Each is checked against the wire schema (`wire.check_request`; what fails goes
to the broker's dead letters and, when it names a request, ends it with
`invalid_request`), refused when it waited in the broker past its deadline
(`queue_timeout`), and added; a request the engine refuses, or that fails while it is
added, becomes an error event for that request only, never a crash.

A test-only hook, off unless its variable is set (`HOLD_STEP_ENV`, a token id): a
request whose prompt holds that token is a request of death, and every engine step
that runs it never returns (the worker holds it: worker.py). The watchdog's tests and
bench/soak.py send one on purpose."""

from __future__ import annotations

import logging
import os
import time

from wsllm.engine.live import LiveRequests
from wsllm.engine.worker_contract import BrokerSide, Engine
from wsllm.types import (
    ERR_ENGINE_BUSY,
    ERR_INTERNAL,
    ERR_INVALID_REQUEST,
    ERR_QUEUE_TIMEOUT,
    EngineBusy,
    GenerateRequest,
    TokenEvent,
    WireError,
)
from wsllm.wire import check_request

log = logging.getLogger(__name__)

#: TEST ONLY: a token id; an engine step running a request whose prompt holds it is held
HOLD_STEP_ENV = "WSLLM_TEST_HOLD_STEP_TOKEN"


class Intake:
    def __init__(self, engine: Engine, broker: BrokerSide, live: LiveRequests) -> None:
        self.engine, self.broker, self.live = engine, broker, live
        hold = os.environ.get(HOLD_STEP_ENV, "")
        self._hold_token = int(hold) if hold.strip().isdigit() else None
        if self._hold_token is not None:
            log.warning(
                "%s=%d: test-only, steps that run such a request never return",
                HOLD_STEP_ENV,
                self._hold_token,
            )
        #: the live requests of death (`HOLD_STEP_ENV`); empty unless it is set
        self.doomed: set[str] = set()

    def holds_step(self) -> bool:
        """Whether the engine's next step runs a request of death (test only)."""
        if self.doomed:
            self.doomed &= set(self.live.ids())
        return bool(self.doomed)

    def admit(self, requests: list[GenerateRequest]) -> list[TokenEvent]:
        """Add what can be added (each then live); the error events of the rest."""
        errors: list[TokenEvent] = []
        for r in requests:
            try:
                r = check_request(r)
            except WireError as e:  # nobody can serve it; fail it if it names a request
                self.broker.dead_letter(r, f"invalid request: {e}")
                rid = getattr(r, "request_id", None)
                if isinstance(rid, str) and rid and rid not in self.live:
                    errors.append(failure(rid, ERR_INVALID_REQUEST, f"the engine cannot serve it: {e}"))
                continue
            if r.expired(time.time()):  # it waited in the broker past its deadline
                errors.append(failure(r.request_id, ERR_QUEUE_TIMEOUT, "no engine took this request in time"))
                continue
            error = self._add(r)
            if error is None:
                self.live.add(r.request_id)
                if self._hold_token is not None and self._hold_token in r.prompt_token_ids:
                    self.doomed.add(r.request_id)
            else:
                errors.append(error)
        return errors

    def _add(self, r: GenerateRequest) -> TokenEvent | None:
        """Add one request to the engine; its error event when that failed. Whatever
        goes wrong costs this request only: the engine is left without it."""
        if r.request_id in self.live:  # delivered twice: the first copy runs
            log.warning("request %s is already running here", r.request_id)
            return None
        try:
            # The gateway's arrival time: queue time then counts the broker's queue too.
            self.engine.add_request(r)
        except EngineBusy as e:
            return failure(r.request_id, ERR_ENGINE_BUSY, str(e))
        except ValueError as e:
            return failure(r.request_id, ERR_INVALID_REQUEST, str(e))
        except Exception:
            log.exception("adding request %s failed; failing it alone", r.request_id)
            try:
                self.engine.abort(r.request_id)
            except Exception:
                log.exception("and aborting it failed too")
            return failure(r.request_id, ERR_INTERNAL, "the engine failed while admitting this request")
        return None


def failure(request_id: str, code: str, message: str, seq: int = 0) -> TokenEvent:
    """The one error event that ends `request_id`."""
    return TokenEvent.failure(request_id, code, message, seq=seq)
