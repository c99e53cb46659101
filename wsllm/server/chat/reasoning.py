"""Reasoning models write their thinking between `<think>` and `</think>` before the
answer (Qwen3, QwQ, DeepSeek-R1). This splits it out as `reasoning_content`. The tags
are a `ReasoningTags` (`THINK` by default), for models that write others.

The opening tag counts only at the very start of the output (after whitespace): an answer
that mentions the tag later is left alone. Some templates open the block in the prompt
(DeepSeek-R1's generation prompt ends with `<think>\\n`; `prompt_opens_think` tells), and
then the output starts inside it and only `</think>` comes. A tag split across deltas is
held back until it is settled; whitespace that starts the reasoning or the answer is
dropped. A block that never closes (cut by `max_tokens`) is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass

from wsllm.server.chat.calls import partial_suffix


@dataclass(slots=True, frozen=True)
class ReasoningTags:
    """The tags around a model's reasoning."""

    open: str
    close: str

    def opened_by(self, prompt_tail: str) -> bool:
        """The rendered prompt (its end) leaves a block open."""
        return prompt_tail.rfind(self.open) > prompt_tail.rfind(self.close)


THINK = ReasoningTags("<think>", "</think>")


def prompt_opens_think(prompt_tail: str, tags: ReasoningTags = THINK) -> bool:
    """The rendered prompt (its end) leaves a reasoning block open."""
    return tags.opened_by(prompt_tail)


class ThinkSplitter:
    """Text deltas in, (reasoning, content) deltas out, for one choice."""

    __slots__ = ("_state", "_buf", "_tags")

    def __init__(self, in_think: bool = False, tags: ReasoningTags = THINK) -> None:
        self._tags = tags
        # start: before the first non-space; think: inside the block; answer: after it
        self._state = "think_lead" if in_think else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._step("", final=True)

    def split(self, text: str) -> tuple[str, str]:
        """The whole output at once (a fresh splitter)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _step(self, text: str, final: bool) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        reasoning = ""
        tags = self._tags
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(tags.open):
                buf, self._state = head[len(tags.open) :], "think_lead"
            elif not final and tags.open.startswith(head):  # nothing yet, or part of the tag
                self._buf = buf
                return "", ""
            else:
                self._state = "answer"
        if self._state == "think_lead":  # drop the whitespace that opens the block
            buf = buf.lstrip()
            if buf:
                self._state = "think"
        if self._state == "think":
            i = buf.find(tags.close)
            if i < 0:
                keep = 0 if final else partial_suffix(buf, tags.close)
                self._buf = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            reasoning, buf, self._state = buf[:i], buf[i + len(tags.close) :], "answer_lead"
        if self._state == "answer_lead":
            buf = buf.lstrip()
            if buf:
                self._state = "answer"
        return reasoning, buf
