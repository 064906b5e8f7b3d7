"""Thinking in `<think>...</think>` (Qwen3, DeepSeek-R1 distills, SmolLM3 and others),
split from the answer as the text streams.

A reply thinks when it opens with `<think>` (whitespace before it aside), or when the
prompt already opened it (templates that end the generation prompt with `<think>`).
A reply that ends while still thinking keeps all of it as reasoning."""

from .markup import held_back

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    def __init__(self, thinking: bool = False):
        """`thinking`: the prompt ends inside a think block."""
        self._state = "think" if thinking else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """More text: (reasoning, content) it completes."""
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            self._begin()
        if self._state == "think":
            reasoning = self._think()
        if self._state == "after":   # the answer starts at its first non-space
            self._buf = self._buf.lstrip()
            self._state = "answer" if self._buf else "after"
        if self._state == "answer":
            content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        reasoning, content = self.feed("")
        rest, self._buf = self._buf, ""
        if self._state == "think":
            return reasoning + rest, content
        return reasoning, content + rest

    def _begin(self) -> None:
        head = self._buf.lstrip()
        if head.startswith(OPEN):
            self._buf, self._state = head[len(OPEN):], "think"
        elif not OPEN.startswith(head):
            self._state = "answer"   # no thinking in this reply

    def _think(self) -> str:
        end = self._buf.find(CLOSE)
        if end < 0:
            cut = len(self._buf) - held_back(self._buf, (CLOSE,))
            reasoning, self._buf = self._buf[:cut], self._buf[cut:]
            return reasoning
        reasoning, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
        self._state = "after"
        return reasoning
