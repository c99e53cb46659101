"""The Responses event machine (wsllm/server/api/responses/render.py): every event it sends
is one the `openai` SDK's own types accept, numbered from 0 without a gap; reasoning,
text and a call become three items in order, each opened and closed once; the whole
response is what the events assemble into; and the conversation kept for a next turn
holds the message and the call, not the reasoning."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCallItem,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseOutputMessage,
    ResponseStreamEvent,
)

from wsllm.server.api.responses.render import ResponseBuilder, input_item, output_turns, settings
from wsllm.server.api.responses.request import ResponsesRequest
from wsllm.server.delta import Delta, TokenLogprob
from wsllm.types import Usage

# the SDK's event classes by their `type` (its union is tagged by the SDK's own marker)
_CLASSES = {
    c.model_fields["type"].annotation.__args__[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])
}


def check_event(ev: dict[str, Any]) -> None:
    """`ev` parses, strictly, as the SDK's class of its type."""
    _CLASSES[ev["type"]].model_validate(ev, strict=True)


CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
ARGS = {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}


def run(deltas: list[Delta], reason: str) -> tuple[ResponseBuilder, list[dict[str, Any]]]:
    req = ResponsesRequest.model_validate(
        {"input": "hi", "tools": [{"type": "function", "name": "get_weather"}]}
    )
    b = ResponseBuilder("resp_abc", settings(req, "m"))
    events = b.start()
    for d in deltas:
        events += b.feed(d)
    events += b.finish(reason, Usage(5, 9, 0))
    return b, events


def answer() -> list[Delta]:
    return [
        Delta(0, "", reasoning="Let me ", num_tokens=2),
        Delta(0, "", reasoning="think.", num_tokens=2),
        Delta(0, "Sure", num_tokens=1, logprobs=[TokenLogprob("Sure", -0.5, [("Sure", -0.5)])]),
        Delta(0, ".", num_tokens=1, logprobs=[TokenLogprob(".", -0.1, [])]),
        Delta(0, "", tool_calls=[CALL, ARGS], num_tokens=3),
        Delta(0, "", finish_reason="tool_calls"),
    ]


def test_every_event_is_the_sdks_and_numbered_in_order() -> None:
    _, events = run(answer(), "tool_calls")
    for ev in events:
        check_event(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_the_whole_response_is_what_the_events_assemble() -> None:
    b, events = run(answer(), "tool_calls")
    r = Response.model_validate(b.response)
    assert r.status == "completed" and r.output_text == "Sure."
    assert (
        r.usage is not None
        and r.usage.output_tokens == 9
        and r.usage.output_tokens_details.reasoning_tokens == 4
    )
    final = events[-1]["response"]
    assert final == b.response
    texts = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    rs, msg, call = final["output"]
    assert rs["content"][0]["text"] == reasoning == "Let me think."
    assert msg["content"][0]["text"] == texts and len(msg["content"][0]["logprobs"]) == 2
    assert call["arguments"] == args and call["call_id"] == "call_1" and call["status"] == "completed"
    assert output_turns(final["output"]) == [
        {"type": "message", "role": "assistant", "content": "Sure."},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
    ]


@pytest.mark.parametrize(("reason", "status", "last"), [("length", "incomplete", "response.incomplete")])
def test_an_answer_cut_by_max_output_tokens_is_incomplete(reason: str, status: str, last: str) -> None:
    b, events = run([Delta(0, "Once upon", num_tokens=2), Delta(0, " a", finish_reason=reason)], reason)
    assert events[-1]["type"] == last and b.response["status"] == status
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert b.response["output"][0]["status"] == "incomplete"
    check_event(events[-1])


def test_a_failure_is_response_failed_with_the_error() -> None:
    req = ResponsesRequest.model_validate({"input": "hi"})
    b = ResponseBuilder("resp_x", settings(req, "m"))
    events = b.start() + b.feed(Delta(0, "Hel", num_tokens=1)) + b.fail("worker_lost", "the engine went away")
    assert [e["type"] for e in events][-2:] == ["response.output_item.done", "response.failed"]
    assert b.response["error"] == {"code": "server_error", "message": "worker_lost: the engine went away"}
    for ev in events:
        check_event(ev)


def test_kept_turns_list_as_the_sdks_input_items() -> None:
    turns = [
        ({"type": "message", "role": "user", "content": "hi"}, ResponseInputMessageItem),
        ({"type": "message", "role": "assistant", "content": "yo"}, ResponseOutputMessage),
        (
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            ResponseFunctionToolCallItem,
        ),
        (
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            ResponseFunctionToolCallOutputItem,
        ),
    ]
    for i, (turn, cls) in enumerate(turns):
        cls.model_validate(input_item(turn, f"item_{i}"), strict=True)
