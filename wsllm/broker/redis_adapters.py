"""LoRA adapters across a Redis deployment: where a request for one waits, and how the
operator's load and unload commands reach a model's engines.

- Routing: a request for adapter A is submitted to the waiting set `{queue}:z:@A`
  (`adapter_target`): the engines that hold A (their heartbeat's `adapters`, which the
  engine side hands to its `Taker`) take from it as from their own routed set, and no
  other engine steals from it (lua/queue_take.lua). A gateway submits a request for an
  adapter only while a live engine holds it (a 404 otherwise, as for an unknown model).
- Commands: the gateway adds the command to the model's abort stream (field `c`), which
  every engine of the model reads each iteration anyway; each engine applies it between
  two steps and answers on the command's reply stream `{model}:cr:{command id}` (field `r`,
  expiring after `REPLY_TTL_MS`), which the gateway reads until every live engine answered
  or its timeout passed. An engine that starts later loads only its own `--lora` flags.
- An unload that every engine that answered applied (`refuse_waiting`): the requests still
  waiting for the adapter are refused at once (nothing holds it, so nothing would take them
  before their queue deadline), each with its failure event in its streams."""

from __future__ import annotations

import time
from typing import Any

from wsllm.broker.base import BrokerUnavailable
from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_keys import UNAVAILABLE, Keys
from wsllm.broker.redis_scripts import REFUSE
from wsllm.config_redis import RedisConfig
from wsllm.types import ERR_INVALID_REQUEST, AdapterCommand, AdapterReply, TokenEvent, WireError
from wsllm.wire import decode_command, decode_reply, encode, encode_adapter

#: how long an engine's answer to a command stays readable
REPLY_TTL_MS = 60_000


def adapter_target(name: str) -> str:
    """The routing target (waiting set suffix) of requests for adapter `name`."""
    return f"@{name}"


def reply_key(keys: Keys, model: str, command_id: str) -> str:
    return f"{keys.model_tag(model)}:cr:{command_id}"


def command_of(fields: dict[bytes, bytes]) -> AdapterCommand | None:
    """The command of an abort-stream entry that carries one (`c`); None when malformed."""
    if len(fields) != 1:
        return None
    try:
        return decode_command(fields[b"c"])
    except (WireError, KeyError):
        return None


def send_reply(r: Any, keys: Keys, model: str, reply: AdapterReply) -> None:
    """An engine's answer (blocking redis-py, the worker's thread)."""
    key = reply_key(keys, model, reply.command_id)
    pipe = r.pipeline(transaction=False)
    pipe.xadd(key, {"r": encode_adapter(reply)})
    pipe.pexpire(key, REPLY_TTL_MS)
    pipe.execute()


async def send_command(
    client: Any,
    keys: Keys,
    model: str,
    command: AdapterCommand,
    engines: int,
    timeout: float,
    cfg: RedisConfig,
) -> list[AdapterReply]:
    """The gateway's side: send `command` to `model`'s engines and gather their replies."""
    try:
        replies = await _send(client, keys, model, command, engines, timeout, cfg.aborts_maxlen)
        gone = replies and len(replies) >= engines and all(r.status in (200, 404) for r in replies)
        if command.action == "unload" and gone:  # no engine holds it now
            await refuse_waiting(client, keys, model, command.name, cfg)
        return replies
    except UNAVAILABLE as e:
        raise BrokerUnavailable(f"redis is unreachable: {e}") from None


async def refuse_waiting(client: Any, keys: Keys, model: str, adapter: str, cfg: RedisConfig) -> list[str]:
    """Refuse the requests waiting for `adapter`, which no engine holds any more."""
    message = f"the LoRA adapter {adapter!r} was unloaded while this request waited"
    before, after = encode([TokenEvent.failure("\0", ERR_INVALID_REQUEST, message, 0)]).split(b'"\\u0000"')
    retention_ms = int(cfg.stream_retention_s * 1000)
    args = [
        adapter_target(adapter),
        keys.out(model, ""),
        retention_ms,
        before,
        after,
        keys.model_tag(model) + ":",
    ]
    refused = await eval_script(client, REFUSE, [keys.queue(model)], args)
    return [r.decode() if isinstance(r, bytes) else str(r) for r in refused or []]


async def _send(
    client: Any, keys: Keys, model: str, command: AdapterCommand, engines: int, timeout: float, maxlen: int
) -> list[AdapterReply]:
    key = reply_key(keys, model, command.command_id)
    await client.xadd(keys.aborts(model), {"c": encode_adapter(command)}, maxlen=maxlen, approximate=True)
    got: list[AdapterReply] = []
    last = "0-0"
    deadline = time.monotonic() + timeout
    try:
        while len(got) < engines and (left := deadline - time.monotonic()) > 0:
            resp = await client.xread({key: last}, count=100, block=max(1, int(min(left, 1.0) * 1000)))
            for _, entries in resp or []:
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    try:
                        got.append(decode_reply(fields[b"r"]))
                    except (WireError, KeyError):
                        continue  # not an answer: nobody's
    finally:
        await client.delete(key)
    return got
