"""Messages the scheduler receives: requests from the tokenizer, results from the worker."""

from dataclasses import dataclass, field

from .codec import (
    ProtocolError, expect_dict, expect_float_list, expect_int, expect_int_list,
    expect_len, expect_list, expect_str,
)
from .to_worker import SamplingParams


@dataclass(slots=True)
class TokenizedRequest:
    """A validated request. `stop_token_ids` already includes EOS unless ignored."""

    TAG = 30
    rid: int
    input_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)

    def to_wire(self):
        return [self.rid, self.input_ids, self.sampling.to_wire(), self.max_new_tokens,
                self.stop_token_ids]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 5, "TokenizedRequest")
        return cls(expect_int(f[0], "rid"), expect_int_list(f[1], "input_ids"),
                   SamplingParams.from_wire(f[2]), expect_int(f[3], "max_new_tokens", 1),
                   expect_int_list(f[4], "stop_token_ids"))


@dataclass(slots=True)
class Abort:
    TAG = 31
    rid: int

    def to_wire(self):
        return [self.rid]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 1, "Abort")
        return cls(expect_int(f[0], "rid"))


@dataclass(slots=True)
class GetStats:
    """The tokenizer relays a client's StatsRequest; answered with Stats(query_id)."""

    TAG = 32
    query_id: int

    def to_wire(self):
        return [self.query_id]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 1, "GetStats")
        return cls(expect_int(f[0], "query_id"))


@dataclass(slots=True)
class StepResult:
    """The tokens of one Step, aligned with `rids`. `top_logprobs[i]` is
    `[ids, logprobs]` or None; `timing` holds per-step measurements (ms)."""

    TAG = 60
    step_id: int
    rids: list[int]
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list | None = None
    timing: dict = field(default_factory=dict)

    def to_wire(self):
        return [self.step_id, self.rids, self.tokens, self.logprobs, self.top_logprobs,
                self.timing]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 6, "StepResult")
        result = cls(expect_int(f[0], "step_id"), expect_int_list(f[1], "rids"),
                     expect_int_list(f[2], "tokens"), expect_float_list(f[3], "logprobs"),
                     None if f[4] is None else expect_list(f[4], "top_logprobs"),
                     expect_dict(f[5], "timing"))
        n = len(result.rids)
        if len(result.tokens) != n or len(result.logprobs) != n or (
                result.top_logprobs is not None and len(result.top_logprobs) != n):
            raise ProtocolError("StepResult fields are not aligned with rids")
        return result


@dataclass(slots=True)
class WorkerError:
    """Step `step_id` failed; the worker has dropped all request state."""

    TAG = 61
    step_id: int
    message: str

    def to_wire(self):
        return [self.step_id, self.message]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 2, "WorkerError")
        return cls(expect_int(f[0], "step_id"), expect_str(f[1], "message"))
