"""Messages a client receives from the tokenizer process."""

from .fields import Float, Int, List, Map, Opt, Str, wire
from .message import message


@message
class StreamChunk:
    """Part (or, when not streaming, all) of a request's output: of its choice
    `index` (0 unless the request asked for n > 1 choices). Where the reply is parsed
    (tools given, or a reasoning model) `text` is the answer only: the thinking is in
    `reasoning`, and each tool call comes whole, once, in `tool_calls` as
    {index, id, name, arguments (JSON text)}."""

    TAG = 20
    rid: str = wire(Str())
    text: str = wire(Str())
    token_ids: list[int] = wire(List(Int()))
    logprobs: list[float] | None = wire(Opt(List(Float())), default=None)
    top_logprobs: list | None = wire(Opt(List()), default=None)
    finish_reason: str | None = wire(Opt(Str()), default=None)
    usage: dict | None = wire(Opt(Map()), default=None)   # Usage.as_dict()
    error: str | None = wire(Opt(Str()), default=None)
    index: int = wire(Int(minimum=0), default=0)
    reasoning: str | None = wire(Opt(Str()), default=None)
    tool_calls: list[dict] | None = wire(Opt(List(Map())), default=None)


@message
class ErrorReply:
    """The request was rejected before it ran. `code` is machine-readable; `param`
    names the client parameter at fault (protocol/sampling.py's name), if one is."""

    TAG = 21
    rid: str | None = wire(Opt(Str()))
    code: str = wire(Str())
    message: str = wire(Str())
    param: str | None = wire(Opt(Str()), default=None)


@message
class StatsReply:
    """Counters of the running server: queue, slots, cache, worker memory and timing."""

    TAG = 22
    rid: str = wire(Str())
    stats: dict = wire(Map())
