"""What the SDK returns: chunks of a stream and the result of a whole request."""

import json
from dataclasses import dataclass, field


class MlxdError(Exception):
    """The server rejected a request (bad input) or could not be reached. `param`
    names the request parameter at fault, where one is."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param


def _top_dicts(tops: list | None) -> list | None:
    if tops is None:
        return None
    return [None if t is None else dict(zip(t[0], t[1])) for t in tops]


@dataclass
class ToolCall:
    """A tool call the model made: `arguments` is JSON text (`args` parses it)."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> dict:
        return json.loads(self.arguments)

    @classmethod
    def from_wire(cls, call: dict) -> "ToolCall":
        return cls(call["id"], call["name"], call["arguments"])


@dataclass
class Chunk:
    """Part of a streamed output (of choice `index`, when the request asked for n > 1).
    `top_logprobs[i]` maps token id -> logprob. With `tools` (or on a reasoning
    model) `text` is the answer only: thinking comes in `reasoning`, each tool call
    whole, once, in `tool_calls`."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    index: int = 0
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_message(cls, msg) -> "Chunk":
        return cls(msg.text, msg.token_ids, msg.logprobs, _top_dicts(msg.top_logprobs),
                   msg.finish_reason, msg.usage, msg.error, msg.index, msg.reasoning or "",
                   [ToolCall.from_wire(c) for c in msg.tool_calls or ()])


@dataclass
class Result:
    """A finished request (or its choice `index`, with n > 1). finish_reason is stop,
    length, tool_calls (it ended with tool calls), abort or error."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    usage: dict | None = None
    error: str | None = None
    index: int = 0
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        self.tool_calls += chunk.tool_calls
        self.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + chunk.top_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage, self.error = (
                chunk.finish_reason, chunk.usage, chunk.error)
