"""Reasoning models write their thinking between `<think>` and `</think>` before the
answer (Qwen3, QwQ, DeepSeek-R1). This splits it out as `reasoning_content`.

`<think>` counts only at the very start of the output (after whitespace): an answer
that mentions the tag later is left alone. Some templates open the block in the prompt
(DeepSeek-R1's generation prompt ends with `<think>\\n`; `prompt_opens_think` tells), and
then the output starts inside it and only `</think>` comes. A tag split across deltas is
held back until it is settled; whitespace that starts the reasoning or the answer is
dropped. A block that never closes (cut by `max_tokens`) is all reasoning."""

from __future__ import annotations

from wsllm.server.tool_parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_think(prompt_tail: str) -> bool:
    """The rendered prompt (its end) leaves a `<think>` block open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class ThinkSplitter:
    """Text deltas in, (reasoning, content) deltas out, for one choice."""

    __slots__ = ("_state", "_buf")

    def __init__(self, in_think: bool = False) -> None:
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
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(OPEN):
                buf, self._state = head[len(OPEN) :], "think_lead"
            elif not final and OPEN.startswith(head):  # nothing yet, or part of the tag
                self._buf = buf
                return "", ""
            else:
                self._state = "answer"
        if self._state == "think_lead":  # drop the whitespace that opens the block
            buf = buf.lstrip()
            if buf:
                self._state = "think"
        if self._state == "think":
            i = buf.find(CLOSE)
            if i < 0:
                keep = 0 if final else partial_suffix(buf, CLOSE)
                self._buf = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            reasoning, buf, self._state = buf[:i], buf[i + len(CLOSE) :], "answer_lead"
        if self._state == "answer_lead":
            buf = buf.lstrip()
            if buf:
                self._state = "answer"
        return reasoning, buf
