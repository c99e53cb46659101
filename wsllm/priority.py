"""Lowering a thread's CPU priority, one helper for every pool of background work (the
gateway's templates and text work, the engine's grammar compiles), so that such work
yields the cores to the engine's step and the event loop. No torch, nothing of wsllm."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def lower_priority(nice: int, what: str = "background work") -> None:
    """Nice the calling thread by `nice` more (capped at 19). Linux keeps a nice value per
    thread; elsewhere the call would renice the whole process, so it is left as it is
    there. A sandbox that forbids it logs a warning naming `what`: the work still runs."""
    if not nice or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:
        log.warning("%s runs at the process's priority: %s", what, e)
