"""`wsllm serve --broker redis://`'s engine children, supervised (`Supervisor`): each
child is started and waited for until its heartbeat is in Redis; then a thread watches
them. A child that exits (a crash, `kill -9`, the watchdog's status 3 after a stall) is
noticed within `POLL_S` (one that exits with status 0 drained on a signal someone sent it,
and stays stopped): its registration is removed at once (the gateways stop
counting it: `/ready` says so), `unhealthy()` says why (the gateway's `/health`
answers 503 with it) until a new child is live, and the child is started again under
the same engine id after a backoff (`BACKOFF_S`, doubled each time a child exits
within `STEADY_S` of going live, at most `MAX_BACKOFF_S`). The new child takes up at
once what the old one held (its own pending entries in the queue, replayed when greedy
or seeded, else `worker_lost`: docs/reliability.md).

The Redis URL (it may hold a password) goes to a child in its environment: a command
line is readable by every user of the machine (`ps`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from wsllm.config import EngineConfig
from wsllm.config_process import LogConfig, ModelRefConfig
from wsllm.config_redis import RedisConfig

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the children are looked at
BACKOFF_S = 1.0  # the first restart's wait
MAX_BACKOFF_S = 30.0
STEADY_S = 60.0  # a child live this long before it exits restarts after BACKOFF_S again


@dataclass
class Child:
    """One engine child: how to start it, and its process now."""

    engine_id: str
    cmd: list[str]
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    live_at: float | None = None  # time.monotonic() its heartbeat was first seen
    backoff_s: float = BACKOFF_S
    down: str | None = None  # why it is not live now

    def start(self) -> None:
        pdeath = _die_with_parent if sys.platform == "linux" else None
        self.popen = subprocess.Popen(self.cmd, env=self.env, preexec_fn=pdeath)
        self.live_at = None


class Supervisor:
    def __init__(self, url: str, rcfg: RedisConfig, children: list[Child]) -> None:
        self.url, self.rcfg, self.children = url, rcfg, children
        self.restarts = 0
        self._redis: Any = None  # one blocking client for every look at the registry
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start every child and wait until each is live; False if one exits first."""
        for c in self.children:
            c.start()
        return all(self._wait_live(c) for c in self.children)

    def watch(self) -> None:
        """Watch (and restart) the children from a thread of their own."""
        self._thread = threading.Thread(target=self._watch, name="wsllm-supervisor", daemon=True)
        self._thread.start()

    def unhealthy(self) -> str | None:
        """Why an engine child is not live now (what /health says), or None."""
        return next((c.down for c in self.children if c.down), None)

    def stop(self) -> None:
        """Stop watching; SIGTERM every child (it drains), then wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.rcfg.drain_timeout_s + 15)
        running = [c.popen for c in self.children if c.popen is not None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in running:
            try:
                p.wait(self.rcfg.drain_timeout_s + 10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self._redis is not None:
            self._redis.close()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            for c in self.children:
                if c.popen is None or c.popen.poll() is None:
                    continue
                if c.popen.returncode == 0:  # it drained on a signal (Ctrl-C reaches the group): meant
                    c.down = f"the engine child {c.engine_id} stopped (status 0); not restarted"
                    log.warning("engine child %s stopped cleanly; not restarting it", c.engine_id)
                    c.popen = None
                    continue
                self._restart(c)

    def _restart(self, c: Child) -> None:
        assert c.popen is not None
        rc = c.popen.returncode
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        steady = c.live_at is not None and time.monotonic() - c.live_at >= STEADY_S
        c.backoff_s = BACKOFF_S if steady else c.backoff_s
        c.down = f"the engine child {c.engine_id} {how}; restarting it in {c.backoff_s:g}s"
        log.error("engine child %s; restarting it in %gs", how, c.backoff_s)
        self._forget(c.engine_id)
        if self._stop.wait(c.backoff_s):
            return
        wait_s, c.backoff_s = c.backoff_s, min(MAX_BACKOFF_S, 2 * c.backoff_s)
        c.start()
        self.restarts += 1
        c.down = f"the engine child {c.engine_id} {how}; a new one is starting (after {wait_s:g}s)"
        if self._wait_live(c):
            c.down = None
            log.warning("engine child %s is live again", c.engine_id)

    def _wait_live(self, c: Child) -> bool:
        """Until the child's heartbeat is in Redis; False if it exits (or we stop) first."""
        from wsllm.broker.health import engine_alive

        assert c.popen is not None
        while c.popen.poll() is None and not self._stop.is_set():
            with contextlib.suppress(Exception):  # Redis may still be starting too
                if engine_alive(self.url, self.rcfg, c.engine_id, self._client()):
                    c.live_at = time.monotonic()
                    return True
            time.sleep(POLL_S)
        if c.popen.poll() is not None:
            print(
                f"wsllm: the engine process exited ({c.popen.returncode}) before it registered",
                file=sys.stderr,
            )
        return False

    def _client(self) -> Any:
        if self._redis is None:
            from wsllm.broker.redis_conn import sync_client

            self._redis = sync_client(self.url, self.rcfg)
        return self._redis

    def _forget(self, engine_id: str) -> None:
        """The dead child's registration goes at once (its TTL would keep it for a while)."""
        from wsllm.broker.health import forget_engine

        try:
            forget_engine(self.url, self.rcfg, engine_id, self._client())
        except Exception as e:  # Redis down: the registration expires by itself
            log.warning("could not remove engine %s from the registry: %s", engine_id, e)


def engine_child(
    url: str, rcfg: RedisConfig, ecfg: EngineConfig, mcfg: ModelRefConfig, lcfg: LogConfig
) -> Child:
    """`serve --broker redis://`'s engine child: its command line and environment (the
    Redis URL in the environment, never on the command line)."""
    flags = _flags(dataclasses.replace(rcfg, broker="memory")) + _flags(ecfg) + _flags(mcfg) + _flags(lcfg)
    env = {k: v for k, v in os.environ.items() if k not in ("WSLLM_BROKER", "WSLLM_REDIS_URL")}
    env["WSLLM_BROKER"] = url
    return Child(rcfg.engine_id or "", [sys.executable, "-m", "wsllm", "engine", *flags], env)


def _die_with_parent() -> None:
    """In the engine child (Linux): SIGTERM it when this process dies, even by SIGKILL."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _flags(cfg: Any) -> list[str]:
    """CLI flags that rebuild `cfg` (fields left at their defaults are left out)."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value is None or value == default or f.metadata.get("flag", True) is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [x for v in value for x in (flag, str(v))]
        else:
            out += [flag, str(value)]
    return out
