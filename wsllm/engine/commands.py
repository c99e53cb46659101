"""The operator's adapter commands (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`),
applied by the worker between two steps: each command the broker delivered is applied to
the engine's adapters (engine/adapters.py), the engine's heartbeat is sent at once (so that
the gateways see its adapters change before the answers reach them), then each command is
answered. A command that fails costs nothing else: the engine serves on. A refusal the
operator can fix (a bad path or file, a rank over the limit) is a 400 saying why; only
what the engine did not foresee is a 500.

A run-time load reads only below `--allow-adapter-dir` (the path resolved, symlinks
followed); without it every run-time load is refused (403): the operator's key must not
make the engine read any file the process can.

Loading reads and checks the adapter on the step thread: the engine's steps pause for as
long as that takes (a few milliseconds for a rank-8 adapter of a small model)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from safetensors import SafetensorError

from wsllm.types import AdapterCommand, AdapterReply

log = logging.getLogger(__name__)


class AdapterRegistry(Protocol):
    """What an engine's adapters offer the operator's commands (engine/adapters.py: Adapters)."""

    def load(self, name: str, path: str) -> Any: ...
    def unload(self, name: str) -> None: ...
    def names(self) -> list[str]: ...


class ServesAdapters(Protocol):
    """An engine, as its adapter commands see it."""

    #: the LoRA adapters it serves; None for an engine that serves none (a fake one)
    adapters: AdapterRegistry | None


class CommandSource(Protocol):
    """The broker's side of the commands (broker.base.EngineBroker declares both; a broker that
    carries none hands none)."""

    def commands(self) -> list[AdapterCommand]: ...
    def reply(self, reply: AdapterReply) -> None: ...


def held_adapters(engine: ServesAdapters) -> list[str]:
    """The names of the adapters `engine` holds (none for an engine without adapters)."""
    return [] if engine.adapters is None else list(engine.adapters.names())


def apply_commands(
    engine: ServesAdapters, broker: CommandSource, engine_id: str, heartbeat: Callable[[], None]
) -> int:
    """Apply and answer the commands waiting for this engine; returns how many."""
    commands = broker.commands()
    if not commands:
        return 0
    replies = [apply_one(engine, c, engine_id) for c in commands]
    try:
        heartbeat()
    except Exception:
        log.exception("heartbeat after adapter commands failed")
    for r in replies:
        broker.reply(r)
    return len(replies)


def apply_one(engine: ServesAdapters, command: AdapterCommand, engine_id: str) -> AdapterReply:
    adapters = engine.adapters
    reply = AdapterReply(command.command_id, engine_id)
    if adapters is None:
        reply.status, reply.error = 400, "this engine serves no LoRA adapters"
        return reply
    if command.action == "load" and (refusal := _refused_path(command.path, adapters.allow_dir)):
        reply.status, reply.error = 403, refusal
        return reply
    try:
        if command.action == "load":
            adapters.load(command.name, command.path)
        else:
            adapters.unload(command.name)
    except KeyError:
        reply.status, reply.error = 404, f"the LoRA adapter {command.name!r} is not loaded"
    except FileNotFoundError as e:  # adapters.AdapterNotFound: nothing at the path (vLLM's 404)
        reply.status, reply.error = 404, str(e)
    except ValueError as e:  # models/lora.py: AdapterError, and the registry's refusals
        reply.status, reply.error = 400, str(e)
    except SafetensorError as e:  # a weights file that is not what it says: the operator's to fix
        reply.status, reply.error = 400, f"{command.path}: its weights (safetensors) cannot be read: {e}"
    except OSError as e:
        reply.status, reply.error = 400, f"{command.path}: the adapter cannot be read: {e}"
    except Exception:
        log.exception("adapter command %s %s failed", command.action, command.name)
        reply.status, reply.error = 500, f"{command.action} of {command.name!r} failed; see the engine's log"
    return reply


def _refused_path(path: str, allow_dir: str | None) -> str | None:
    """Why a run-time load may not read `path`; None when it is below `allow_dir`."""
    if allow_dir is None:
        return "run-time adapter loads are off on this engine: --allow-adapter-dir names where they may come from"
    try:
        inside = Path(path).expanduser().resolve().is_relative_to(Path(allow_dir).expanduser().resolve())
    except (OSError, RuntimeError, ValueError):
        inside = False
    return None if inside else f"{path!r} is not below --allow-adapter-dir ({allow_dir})"
