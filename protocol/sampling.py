"""Every parameter a client may set on a request, declared once: its name, kind,
default, the bounds a client's value must keep, and which APIs take it under which name.

A parameter the worker needs is a field of `SamplingParams` declared with `param()`;
the others (`REQUEST_PARAMS`) stay in the tokenizer and the scheduler. `PARAMS` is all
of them: the tokenizer validates a request by it (tokenizer_proc/params.py), the HTTP
APIs build their body fields from it and pass the values on under its names
(tokenizer_proc/http/), and a ZeroMQ client sends these names as they are."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .codec import ProtocolError
from .fields import WIRE, Bool, Float, Int, Kind, List, Opt, Str, wire
from .message import message

PARAM = "param"        # the metadata key of a SamplingParams field a client sets
INT32_MAX = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0      # presence and frequency, as OpenAI bounds them
MAX_REPETITION_PENALTY = 100.0
MAX_CHOICES = 16       # n
MAX_TIMEOUT = 1e6      # seconds

# The repetition penalty counts this many of the latest context tokens (prompt and
# output), as mlx_lm's default does; the scheduler sends the prompt's tail that long.
REPETITION_CONTEXT = 20


@dataclass(frozen=True)
class Param:
    """One client parameter, under its OpenAI name (the core's).

    `kind`: "number", "integer" or "flag", whose values the tokenizer checks against
    `lo`/`hi` here; or a kind checked by its own code: "stop", "token_ids",
    "logit_bias", "cache_prefixes" (tokenizer_proc/params.py), "options"
    (tools/request.py), "response_format" (constraints.py). `default`: the value when
    not sent (None: unset; for max_tokens, the server's). `nullable`: null counts as
    not sent. `openai`: both OpenAI bodies have a field of its name, sent on as is
    (False: a route maps it itself, e.g. max_completion_tokens, the completions API's
    integer `logprobs`, chat-only fields). `anthropic`: the name of the Messages API
    field sent on as this parameter, where that API takes it."""

    name: str
    kind: str
    default: Any = None
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    nullable: bool = False
    openai: bool = True
    anthropic: str | None = None

    @property
    def scalar(self) -> bool:
        """A number, integer or flag: checked by its declaration alone."""
        return self.kind in ("number", "integer", "flag")

    def outside(self, value) -> bool:
        """A value of the right kind that the bounds refuse."""
        return value < self.lo or value > self.hi or (self.lo_open and value == self.lo)

    def bounds(self) -> str:
        return f"({self.lo}, {self.hi}]" if self.lo_open else f"[{self.lo}, {self.hi}]"


def param(kind: Kind, default, **declared):
    """A SamplingParams field that a client sets: its wire kind, its default, and the
    rest of its `Param` (bounds, APIs); the client's kind follows the wire kind."""
    return dataclasses.field(default=default, metadata={
        WIRE: kind, PARAM: Param("", _client_kind(kind), default, **declared,
                                 nullable=isinstance(kind, Opt))})


def _client_kind(kind: Kind) -> str:
    inner = kind.kind if isinstance(kind, Opt) else kind
    return {Float: "number", Int: "integer", Bool: "flag"}[type(inner)]


@message
class SamplingParams:
    """How the worker picks a token. temperature 0 means greedy. The penalties,
    `logit_bias` (`bias_ids[i]` gets `bias_values[i]` added) and `min_tokens` change
    the logits a row samples from (worker_proc/penalties.py); each off by default.
    `grammar` (an llguidance grammar, compiled and checked by the tokenizer process)
    constrains the tokens a row may pick (worker_proc/grammar.py). Whether a part is
    on is asked of these methods only."""

    temperature: float = param(Float(), 0.0, lo=0.0, anthropic="temperature")
    top_p: float = param(Float(), 1.0, lo=0.0, hi=1.0, lo_open=True, anthropic="top_p")
    top_k: int = param(Int(minimum=0), 0, lo=-1, hi=INT32_MAX, anthropic="top_k")  # -1: off
    min_p: float = param(Float(), 0.0, lo=0.0, hi=1.0)
    seed: int | None = param(Opt(Int()), None, lo=0, hi=MAX_SEED)
    top_logprobs: int = param(Int(minimum=0), 0, lo=0, hi=MAX_TOP_LOGPROBS, openai=False)
    presence_penalty: float = param(Float(), 0.0, lo=-MAX_PENALTY, hi=MAX_PENALTY)
    frequency_penalty: float = param(Float(), 0.0, lo=-MAX_PENALTY, hi=MAX_PENALTY)
    repetition_penalty: float = param(Float(), 1.0, lo=0.0, hi=MAX_REPETITION_PENALTY,
                                      lo_open=True)
    bias_ids: list[int] = wire(List(Int()), default_factory=list)   # from logit_bias
    bias_values: list[float] = wire(List(Float()), default_factory=list)
    min_tokens: int = param(Int(minimum=0), 0, lo=0, hi=INT32_MAX)
    grammar: str | None = wire(Opt(Str()), default=None)   # from response_format
    # a reasoning model thinks at most this many tokens, then its think block's end is
    # forced (worker_proc/thinking.py); the tokenizer sets the markers' ids and whether
    # the prompt opened the block, and clears the budget where the request does not think
    thinking_budget: int | None = param(Opt(Int(minimum=0)), None, lo=0, hi=INT32_MAX)
    think_start_ids: list[int] = wire(List(Int()), default_factory=list)
    think_end_ids: list[int] = wire(List(Int()), default_factory=list)
    think_opened: bool = wire(Bool(), default=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalises_repeats(self) -> bool:
        """The repetition penalty: it needs the prompt's tail and the output."""
        return self.repetition_penalty != 1.0

    @property
    def penalises_counts(self) -> bool:
        """The presence or frequency penalty: it counts the output's tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def counts_tokens(self) -> bool:
        """A penalty needs the tokens of the request's context."""
        return self.penalises_repeats or self.penalises_counts

    @property
    def biases_logits(self) -> bool:
        return bool(self.bias_ids)

    def holds_stops(self, generated: int = 0) -> bool:
        """min_tokens still holds the stop ids back after `generated` tokens."""
        return self.min_tokens > generated

    @property
    def processes_logits(self) -> bool:
        """Anything changes the logits before the token is picked."""
        return self.counts_tokens or self.biases_logits or self.holds_stops()

    @property
    def budgets_thinking(self) -> bool:
        return self.thinking_budget is not None and bool(self.think_end_ids)

    @property
    def needs_output_ids(self) -> bool:
        """The worker rebuilds the row's state from its output so far when it resumes
        (penalty counts, the grammar's position, the thinking's count)."""
        return self.counts_tokens or self.grammar is not None or self.budgets_thinking

    def check(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0
                and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1
                and all(map(math.isfinite, (self.presence_penalty, self.frequency_penalty,
                                            self.repetition_penalty, *self.bias_values)))
                and self.repetition_penalty > 0
                and len(self.bias_ids) == len(self.bias_values)):
            raise ProtocolError(f"sampling parameters out of range: {self}")


# The parameters the worker does not see (the tokenizer and the scheduler use them).
REQUEST_PARAMS = (
    # chat also takes it as max_completion_tokens; Anthropic's body requires it
    Param("max_tokens", "integer", None, lo=1, hi=INT32_MAX, openai=False,
          anthropic="max_tokens"),
    Param("stop", "stop", anthropic="stop_sequences"),
    Param("stop_token_ids", "token_ids"),
    Param("ignore_eos", "flag", False),
    Param("skip_special_tokens", "flag", True),   # special tokens' text left out
    Param("logprobs", "flag", False, openai=False),   # completions: N, with top_logprobs
    Param("timeout", "number", None, lo=0.0, hi=MAX_TIMEOUT, lo_open=True, nullable=True),
    Param("n", "integer", 1, lo=1, hi=MAX_CHOICES, openai=False),
    Param("logit_bias", "logit_bias", openai=False),   # OpenAI's keys are strings
    # chat only; Anthropic's tools and tool_choice are mapped (http/tool_calls.py)
    Param("tools", "options", openai=False),
    Param("tool_choice", "options", openai=False),
    Param("parallel_tool_calls", "options", openai=False),
    Param("chat_template_kwargs", "options", openai=False),
    Param("enable_thinking", "options", openai=False),
    # the final (assistant) message is continued, rendered open (a prefill)
    Param("continue_final_message", "options", openai=False),
    Param("response_format", "response_format", openai=False),
    # prefixes to pin in the prefix cache, each as the chat it renders from
    # (Anthropic's cache_control, http/anthropic_api.py; checked in params.py)
    Param("cache_prefixes", "cache_prefixes", openai=False),
)


def _sampling_params() -> tuple[Param, ...]:
    return tuple(dataclasses.replace(f.metadata[PARAM], name=f.name)
                 for f in dataclasses.fields(SamplingParams) if PARAM in f.metadata)


SAMPLING_PARAMS = _sampling_params()
PARAMS = {p.name: p for p in SAMPLING_PARAMS + REQUEST_PARAMS}
