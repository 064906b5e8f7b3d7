"""Messages the tokenizer process receives: from clients and from the scheduler."""

from dataclasses import replace

from .fields import Bool, Float, Int, List, Map, Opt, Str, Struct, wire
from .message import message
from .to_scheduler import WorkerLimits

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_RID_CHARS = 256      # a client's request id
MAX_MESSAGES = 4096      # chat messages in one request
MAX_API_KEY_CHARS = 512
MAX_MODEL_CHARS = 256    # a model's name


@message(rid_in_errors=True)
class GenerateRequest:
    """A client request. Exactly one of prompt / messages / input_ids is set;
    `params` are OpenAI-style names, validated by the tokenizer process."""

    TAG = 10
    rid: str = wire(Str(max_len=MAX_RID_CHARS))
    prompt: str | None = wire(Opt(Str()), default=None)
    messages: list | None = wire(Opt(List(max_len=MAX_MESSAGES)), default=None)
    input_ids: list[int] | None = wire(Opt(List(Int())), default=None)
    params: dict = wire(Map(), default_factory=dict)
    stream: bool = wire(Bool(), default=False)
    api_key: str = wire(Str(max_len=MAX_API_KEY_CHARS), default="", repr=False)   # see --api-key
    model: str | None = wire(Opt(Str(max_len=MAX_MODEL_CHARS)), default=None)   # None: the first


@message
class AbortRequest:
    TAG = 11
    rid: str = wire(Str(max_len=MAX_RID_CHARS))
    api_key: str = wire(Str(max_len=MAX_API_KEY_CHARS), default="", repr=False)


@message
class StatsRequest:
    """A client asks for the server's counters (of `model`, by default the first
    served); answered with StatsReply(rid)."""

    TAG = 12
    rid: str = wire(Str(max_len=MAX_RID_CHARS))
    api_key: str = wire(Str(max_len=MAX_API_KEY_CHARS), default="", repr=False)
    model: str | None = wire(Opt(Str(max_len=MAX_MODEL_CHARS)), default=None)


@message
class Stats:
    """The scheduler's answer to GetStats(query_id)."""

    TAG = 41
    query_id: int = wire(Int())
    stats: dict = wire(Map())


@message
class SchedulerReady:
    """The scheduler is up: the worker's limits, how many requests run at once, the
    name of the model it serves ("": the front end's first), and its process id (the
    launcher replaces an unresponsive engine's scheduler only while that is this one)."""

    TAG = 42
    limits: WorkerLimits = wire(Struct(WorkerLimits))
    max_running_requests: int = wire(Int(minimum=1))
    model: str = wire(Str(max_len=MAX_MODEL_CHARS), default="")
    pid: int = wire(Int(minimum=0), default=0)


@message
class Usage:
    """Token counts of one request, counted by the scheduler."""

    prompt_tokens: int = wire(Int(minimum=0))
    completion_tokens: int = wire(Int(minimum=0))
    cached_tokens: int = wire(Int(minimum=0))   # prompt tokens whose KV was reused
    # of those, read from the disk tier (--kv-disk); the rest came from memory
    disk_tokens: int = wire(Int(minimum=0), default=0)
    # prompt tokens it computed and pinned (cache_control), none of the cached ones
    pinned_tokens: int = wire(Int(minimum=0), default=0)
    # completion tokens that were verified draft tokens (speculative decoding)
    accepted_tokens: int = wire(Int(minimum=0), default=0)
    # times the request went on after the death of a process running it
    resumes: int = wire(Int(minimum=0), default=0)

    def with_completion_tokens(self, n: int) -> "Usage":
        """The same request's usage with `n` tokens generated (the tokenizer's count
        when it ends a request on a stop string before the scheduler does)."""
        return replace(self, completion_tokens=n)


@message
class TokenEntry:
    """New tokens of one request in one step. `finish_reason` and `usage` on the
    last; `usage` on the first token's too (cached_tokens is known then)."""

    rid: int = wire(Int())
    token_ids: list[int] = wire(List(Int()))
    logprobs: list[float] = wire(List(Float()))
    top_logprobs: list | None = wire(Opt(List()), default=None)
    finish_reason: str | None = wire(Opt(Str(choices=FINISH_REASONS)), default=None)
    usage: Usage | None = wire(Opt(Struct(Usage)), default=None)
    error: str | None = wire(Opt(Str()), default=None)


@message
class TokenBatch:
    """Everything the scheduler has for the tokenizer after one step."""

    TAG = 40
    entries: list[TokenEntry] = wire(List(Struct(TokenEntry)))
    # the engine's prefix cache since its last batch, as block hashes
    # (runtime/prefix_hash.py): everything before dropped, then stored, removed
    cache_reset: bool = wire(Bool(), default=False)
    cache_stored: list[int] = wire(List(Int()), default_factory=list)
    cache_removed: list[int] = wire(List(Int()), default_factory=list)
    # its disk tier (--kv-disk) likewise: the prefix hashes where entries a prefill
    # can resume from end (scheduler_proc/disk_tier.py)
    disk_reset: bool = wire(Bool(), default=False)
    disk_stored: list[int] = wire(List(Int()), default_factory=list)
    disk_removed: list[int] = wire(List(Int()), default_factory=list)
