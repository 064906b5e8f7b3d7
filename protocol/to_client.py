"""Messages a client receives from the tokenizer process."""

from dataclasses import dataclass

from .codec import (
    expect_dict, expect_float_list, expect_int_list, expect_len, expect_list,
    expect_str, optional,
)


@dataclass(slots=True)
class StreamChunk:
    """Part (or, when not streaming, all) of a request's output."""

    TAG = 20
    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None

    def to_wire(self):
        return [self.rid, self.text, self.token_ids, self.logprobs, self.top_logprobs,
                self.finish_reason, self.usage, self.error]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 8, "StreamChunk")
        return cls(expect_str(f[0], "rid"), expect_str(f[1], "text"),
                   expect_int_list(f[2], "token_ids"),
                   optional(expect_float_list, f[3], "logprobs"),
                   optional(expect_list, f[4], "top_logprobs"),
                   optional(expect_str, f[5], "finish_reason"),
                   optional(expect_dict, f[6], "usage"), optional(expect_str, f[7], "error"))


@dataclass(slots=True)
class ErrorReply:
    """The request was rejected before it ran. `code` is machine-readable."""

    TAG = 21
    rid: str | None
    code: str
    message: str

    def to_wire(self):
        return [self.rid, self.code, self.message]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 3, "ErrorReply")
        return cls(optional(expect_str, f[0], "rid"), expect_str(f[1], "code"),
                   expect_str(f[2], "message"))


@dataclass(slots=True)
class StatsReply:
    """Counters of the running server: queue, slots, cache, worker memory and timing."""

    TAG = 22
    rid: str
    stats: dict

    def to_wire(self):
        return [self.rid, self.stats]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 2, "StatsReply")
        return cls(expect_str(f[0], "rid"), expect_dict(f[1], "stats"))
