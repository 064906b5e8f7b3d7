"""Messages the tokenizer process receives: from clients and from the scheduler."""

from dataclasses import dataclass, field

from .codec import (
    ProtocolError, expect_bool, expect_dict, expect_float_list, expect_int,
    expect_int_list, expect_len, expect_list, expect_str, optional,
)

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class GenerateRequest:
    """A client request. Exactly one of prompt / messages / input_ids is set;
    `params` are OpenAI-style names, validated by the tokenizer process."""

    TAG = 10
    rid: str
    prompt: str | None = None
    messages: list | None = None
    input_ids: list[int] | None = None
    params: dict = field(default_factory=dict)
    stream: bool = False

    def to_wire(self):
        return [self.rid, self.prompt, self.messages, self.input_ids, self.params,
                self.stream]

    @classmethod
    def from_wire(cls, f):
        rid = expect_str(f[0], "rid") if f else None
        try:
            expect_len(f, 6, "GenerateRequest")
            return cls(rid, optional(expect_str, f[1], "prompt"),
                       optional(expect_list, f[2], "messages"),
                       optional(expect_int_list, f[3], "input_ids"),
                       expect_dict(f[4], "params"), expect_bool(f[5], "stream"))
        except ProtocolError as exc:
            raise ProtocolError(str(exc), rid=rid) from None


@dataclass(slots=True)
class AbortRequest:
    TAG = 11
    rid: str

    def to_wire(self):
        return [self.rid]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 1, "AbortRequest")
        return cls(expect_str(f[0], "rid"))


@dataclass(slots=True)
class StatsRequest:
    """A client asks for the server's counters; answered with StatsReply(rid)."""

    TAG = 12
    rid: str

    def to_wire(self):
        return [self.rid]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 1, "StatsRequest")
        return cls(expect_str(f[0], "rid"))


@dataclass(slots=True)
class Stats:
    """The scheduler's answer to GetStats(query_id)."""

    TAG = 41
    query_id: int
    stats: dict

    def to_wire(self):
        return [self.query_id, self.stats]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 2, "Stats")
        return cls(expect_int(f[0], "query_id"), expect_dict(f[1], "stats"))


@dataclass(slots=True)
class TokenEntry:
    """New tokens of one request in one step; `usage` and `finish_reason` on the last."""

    rid: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None

    def to_wire(self):
        return [self.rid, self.token_ids, self.logprobs, self.top_logprobs,
                self.finish_reason, self.usage, self.error]

    @classmethod
    def from_wire(cls, f):
        expect_list(f, "entry")
        expect_len(f, 7, "TokenEntry")
        entry = cls(expect_int(f[0], "rid"), expect_int_list(f[1], "token_ids"),
                    expect_float_list(f[2], "logprobs"),
                    optional(expect_list, f[3], "top_logprobs"),
                    optional(expect_str, f[4], "finish_reason"),
                    optional(expect_dict, f[5], "usage"), optional(expect_str, f[6], "error"))
        if entry.finish_reason is not None and entry.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"unknown finish_reason {entry.finish_reason!r}")
        return entry


@dataclass(slots=True)
class TokenBatch:
    """Everything the scheduler has for the tokenizer after one step."""

    TAG = 40
    entries: list[TokenEntry]

    def to_wire(self):
        return [[e.to_wire() for e in self.entries]]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 1, "TokenBatch")
        return cls([TokenEntry.from_wire(e) for e in expect_list(f[0], "entries")])
