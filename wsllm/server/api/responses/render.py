"""OpenAI's Responses shapes of one answer: the output items (reasoning, message,
function calls), the response object, and the typed stream events the `openai` SDK
reads, each with its `sequence_number`.

One machine (`ResponseBuilder`) is fed the answer's deltas and returns the events they
make; the whole response of a call that was not streamed is the same machine's
`response` at the end, so a streamed answer and a whole one cannot differ. An output
item opens when the kind of text changes (reasoning, content, a call) and closes when
the next one opens or the answer ends:

    response.created, response.in_progress
    per item: response.output_item.added
      reasoning: content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
      message:   content_part.added, output_text.delta..., output_text.done, content_part.done
      call:      function_call_arguments.delta, function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete past max_output_tokens, response.failed)"""

from __future__ import annotations

import time
from typing import Any

from wsllm.server.api.responses.request import ResponsesRequest
from wsllm.server.api.responses.translate import Turn
from wsllm.server.chat.output import FINISH_TOOL_CALLS
from wsllm.server.delta import Delta, TokenLogprob
from wsllm.types import ERR_INVALID_REQUEST, ERR_RATE_LIMITED, FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Usage

Event = dict[str, Any]
# our error codes as the words of OpenAI's `ResponseError.code` (the rest: server_error)
_ERROR_CODES = {ERR_RATE_LIMITED: "rate_limit_exceeded", ERR_INVALID_REQUEST: "invalid_prompt"}


def settings(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """What a response echoes of its request."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "model": model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": req.tool_choice_json(),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_logprobs": req.top_logprobs,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "background": bool(req.background),
    }


def usage_json(u: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


def _logprobs(lps: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    def entry(token: str, lp: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return [entry(t.token, t.logprob) | {"top_logprobs": [entry(*x) for x in t.top]} for t in lps or []]


class ResponseBuilder:
    """One response's output items and events, from its deltas (one choice)."""

    def __init__(self, response_id: str, echo: dict[str, Any], created_at: int | None = None) -> None:
        self.id = response_id
        self._hex = response_id.removeprefix("resp_")
        self.response: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": created_at or int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "output": [],
            "usage": None,
        } | echo
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self.reasoning_tokens = 0

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]  # type: ignore[no-any-return]

    def _event(self, kind: str, **fields: Any) -> Event:
        ev = {"type": kind, "sequence_number": self._seq} | fields
        self._seq += 1
        return ev

    def _snapshot(self, kind: str) -> Event:
        return self._event(kind, response=dict(self.response, output=list(self.output)))

    def start(self) -> list[Event]:
        return [self._snapshot("response.created"), self._snapshot("response.in_progress")]

    def feed(self, d: Delta) -> list[Event]:
        """The events of one delta of the answer."""
        events: list[Event] = []
        if d.reasoning:
            self.reasoning_tokens += d.num_tokens if not d.text else 0
            events += self._write("reasoning", d.reasoning)
        if d.text:
            events += self._write("message", d.text, d.logprobs)
        for call in d.tool_calls or []:
            events += self._call(call)
        return events

    def finish(self, reason: str | None, usage: Usage) -> list[Event]:
        """The closing events: the open item's, then the response's own."""
        events = self._close("incomplete" if reason in (FINISH_LENGTH, FINISH_ABORT) else "completed")
        self.response["usage"] = usage_json(usage, self.reasoning_tokens)
        if reason == FINISH_LENGTH:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*events, self._snapshot("response.incomplete")]
        self.response["status"] = "cancelled" if reason == FINISH_ABORT else "completed"
        assert reason in (FINISH_STOP, FINISH_TOOL_CALLS, FINISH_ABORT, None), reason
        return [*events, self._snapshot("response.completed")]

    def fail(self, code: str, message: str) -> list[Event]:
        """A failure mid-way: the open item is incomplete and the response failed. Its
        `error.code` is one of the words OpenAI's clients know; ours leads the message."""
        events = self._close("incomplete")
        self.response["status"] = "failed"
        known = _ERROR_CODES.get(code, "server_error")
        self.response["error"] = {"code": known, "message": f"{code}: {message}"}
        return [*events, self._snapshot("response.failed")]

    # -- items -------------------------------------------------------------------------

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self._hex}{len(self.output):03d}"

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _write(self, kind: str, text: str, lps: list[TokenLogprob] | None = None) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._add_text_item(kind)
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return [
                *events,
                self._event("response.reasoning_text.delta", content_index=0, delta=text, **self._where()),
            ]
        lp = _logprobs(lps)
        if lps is not None:
            part.setdefault("logprobs", []).extend(lp)
        delta = self._event(
            "response.output_text.delta", content_index=0, delta=text, logprobs=lp, **self._where()
        )
        return [*events, delta]

    def _add_text_item(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": self._item_id("rs"), "type": "reasoning", "summary": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": self._item_id("msg"), "type": "message", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": []}
        item |= {"status": "in_progress", "content": []}
        self.output.append(item)
        self._open = item
        added = self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))
        item["content"].append(part)
        return [
            added,
            self._event("response.content_part.added", content_index=0, part=dict(part), **self._where()),
        ]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        """A chat tool-call delta: the first of a call names it (a new item), the next
        carries its arguments (chat/output.py sends each call whole, in two deltas)."""
        fn = delta.get("function") or {}
        if "id" in delta:
            events = self._close("completed")
            item = {
                "id": self._item_id("fc"),
                "type": "function_call",
                "call_id": delta["id"],
                "name": fn.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            self.output.append(item)
            self._open = item
            return [
                *events,
                self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)),
            ]
        args = fn.get("arguments") or ""
        if self._open is None or self._open["type"] != "function_call" or not args:
            return []
        self._open["arguments"] += args
        return [self._event("response.function_call_arguments.delta", delta=args, **self._where())]

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        item["status"] = status
        events: list[Event] = []
        if item["type"] == "function_call":
            done = {"name": item["name"], "arguments": item["arguments"]}
            events.append(self._event("response.function_call_arguments.done", **done, **where))
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if kind == "reasoning_text" else {"logprobs": part.get("logprobs", [])}
            events.append(
                self._event(f"response.{kind}.done", content_index=0, text=part["text"], **extra, **where)
            )
            events.append(
                self._event("response.content_part.done", content_index=0, part=dict(part), **where)
            )
        events.append(
            self._event("response.output_item.done", output_index=where["output_index"], item=_copy(item))
        )
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return dict(item, content=[dict(p) for p in item["content"]]) if "content" in item else dict(item)


def output_turns(output: list[dict[str, Any]]) -> list[Turn]:
    """A response's output in the kept shape of responses_schema (for the next turn):
    messages and calls; reasoning is not shown to the model again."""
    out: list[Turn] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"])
            out.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "function_call":
            out.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return out


def input_item(turn: Turn, item_id: str) -> dict[str, Any]:
    """A kept turn as `GET /v1/responses/{id}/input_items` lists it (OpenAI's item shapes)."""
    kind = turn["type"]
    if kind == "message":
        assistant, kept = turn["role"] == "assistant", turn["content"]
        part = {"type": "output_text", "text": kept, "annotations": []} if assistant else None
        content = kept if isinstance(kept, list) else [part or {"type": "input_text", "text": kept}]
        return {
            "id": item_id,
            "type": "message",
            "role": turn["role"],
            "content": content,
            "status": "completed",
        }
    return {"id": item_id} | turn | {"status": "completed"}
