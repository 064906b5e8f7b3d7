"""One reply's output parser: thinking split off first, then tool calls found in the
answer (never in the thinking)."""

from dataclasses import dataclass, field

from .blocks import BlockParser
from .markup import ToolCall
from .reasoning import ThinkParser


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class OutputParser:
    """Fed the reply's text as it streams (`feed`), then `finish`ed once; each returns
    what the text completes. Either part may be absent."""

    def __init__(self, tools: BlockParser | None = None, think: ThinkParser | None = None):
        self.tools = tools
        self.think = think
        self.calls = 0   # tool calls found so far

    def feed(self, text: str) -> Delta:
        reasoning, content = self.think.feed(text) if self.think else ("", text)
        return self._answer(reasoning, content, last=False)

    def finish(self) -> Delta:
        reasoning, content = self.think.finish() if self.think else ("", "")
        return self._answer(reasoning, content, last=True)

    def _answer(self, reasoning: str, content: str, last: bool) -> Delta:
        if self.tools is None:
            return Delta(content, reasoning)
        content, calls = self.tools.feed(content)
        if last:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        self.calls += len(calls)
        return Delta(content, reasoning, calls)
