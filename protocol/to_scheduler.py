"""Messages the scheduler receives: requests from the tokenizer, results from the worker."""

from .codec import ProtocolError
from .fields import Bool, Float, Int, List, Opt, Str, Struct, wire
from .message import message
from .sampling import SamplingParams


MAX_PINS = 4   # cache_control breakpoints per request, as Anthropic's API allows


@message
class Pin:
    """Keep the KV of the prompt's first `offset` tokens in the prefix cache ahead of
    unpinned KV for `ttl_seconds` (Anthropic's cache_control)."""

    offset: int = wire(Int(minimum=1))
    ttl_seconds: int = wire(Int(minimum=1))


@message
class TokenizedRequest:
    """A validated request. `stop_token_ids` already includes EOS unless ignored;
    `pin`: prefixes of the prompt to pin in the prefix cache once computed.
    A request resumed after the death of the process running it carries the tokens
    it had generated (`output_ids`, streamed already: it goes on after them, its
    sampling state rebuilt from them as after a retraction) and how many times it
    was resumed (`resumes`; request_limits.resume_refusal)."""

    TAG = 30
    rid: int = wire(Int())
    input_ids: list[int] = wire(List(Int()))
    sampling: SamplingParams = wire(Struct(SamplingParams))
    max_new_tokens: int = wire(Int(minimum=1))
    stop_token_ids: list[int] = wire(List(Int()), default_factory=list)
    # (the scheduler refuses a request whose pin ends past its prompt)
    pin: list[Pin] = wire(List(Struct(Pin), max_len=MAX_PINS), default_factory=list)
    output_ids: list[int] = wire(List(Int()), default_factory=list)
    resumes: int = wire(Int(minimum=0), default=0)


@message
class Abort:
    TAG = 31
    rid: int = wire(Int())


@message
class GetStats:
    """The tokenizer relays a client's StatsRequest; answered with Stats(query_id)."""

    TAG = 32
    query_id: int = wire(Int())


@message
class StepTiming:
    """The worker's measurements of one step (ms; see ModelRunner). `wait_ms` and
    `idle_ms` are None after a step that left nothing running: the wait that
    followed was for work, not a round trip. Memory figures are bytes."""

    compute_ms: float = wire(Float(), default=0.0)
    wait_ms: float | None = wire(Opt(Float()), default=None)
    idle_ms: float | None = wire(Opt(Float()), default=None)
    chained_wait_ms: float = wire(Float(), default=0.0)
    chained: bool = wire(Bool(), default=False)
    active_memory: int = wire(Int(minimum=0), default=0)
    peak_memory: int = wire(Int(minimum=0), default=0)


@message
class StepResult:
    """The tokens of one Step, aligned with `rids`. `top_logprobs[i]` is
    `[ids, logprobs]` or None. With `runs` (aligned with `rids`), row i gave
    `runs[i]` tokens in order (a verified draft's accepted tokens and the one after
    them), and `tokens`, `logprobs`, `top_logprobs` hold every row's run in turn;
    empty: one token each."""

    TAG = 60
    step_id: int = wire(Int())
    rids: list[int] = wire(List(Int()))
    tokens: list[int] = wire(List(Int()))
    logprobs: list[float] = wire(List(Float()))
    top_logprobs: list | None = wire(Opt(List()), default=None)
    timing: StepTiming = wire(Struct(StepTiming), default_factory=StepTiming)
    runs: list[int] = wire(List(Int(minimum=1)), default_factory=list)
    # the disk tier: entries no longer there (evicted, unusable, or not written), and
    # the prefills whose disk_tokens were computed because a read missed
    disk_gone: list[str] = wire(List(Str(max_len=128)), default_factory=list)
    disk_missed: list[int] = wire(List(Int()), default_factory=list)

    def check(self):
        if self.runs and len(self.runs) != len(self.rids):
            raise ProtocolError("StepResult runs are not aligned with rids")
        n = sum(self.runs) if self.runs else len(self.rids)
        if len(self.tokens) != n or len(self.logprobs) != n or (
                self.top_logprobs is not None and len(self.top_logprobs) != n):
            raise ProtocolError("StepResult fields are not aligned with rids")

    def row_runs(self) -> list[tuple[int, slice]]:
        """(rid, its tokens' slice of `tokens`) per row."""
        out, at = [], 0
        for rid, n in zip(self.rids, self.runs or [1] * len(self.rids)):
            out.append((rid, slice(at, at + n)))
            at += n
        return out


@message
class WorkerError:
    """Step `step_id` failed; the worker has dropped all request state."""

    TAG = 61
    step_id: int = wire(Int())
    message: str = wire(Str())


@message
class WorkerLimits:
    """What the worker holds and runs on, reported once in WorkerReady: the
    scheduler books KV against it, the tokenizer checks prompts against it."""

    kv_capacity: int = wire(Int(minimum=1))          # KV pool slots
    # tokens the padded layout's decode caches may span (0 in pages: rows read the pool)
    decode_cache_tokens: int = wire(Int(minimum=0))
    max_context: int = wire(Int(minimum=1))
    vocab_size: int = wire(Int(minimum=1))           # token ids the model embeds: [0, vocab_size)
    bytes_per_token: int = wire(Int(minimum=0))      # KV of one token, all layers (0: no KV layer)
    kv_pool_bytes: int = wire(Int(minimum=1))
    weights_bytes: int = wire(Int(minimum=0))
    buffer_cache_bytes: int = wire(Int(minimum=0))   # MLX's buffer cache limit
    kv_dtype: str = wire(Str())
    device: str = wire(Str())
    blas: str = wire(Str())
    quantized: bool = wire(Bool())
    dequantize: bool = wire(Bool())
    overlap: bool = wire(Bool())
    # Recurrent-state models: state slots the scheduler books (one per running
    # request, then `snapshot_slots` for snapshots) and the bytes of one; 0 for
    # attention-only models.
    state_slots: int = wire(Int(minimum=0), default=0)
    snapshot_slots: int = wire(Int(minimum=0), default=0)
    state_slot_bytes: int = wire(Int(minimum=0), default=0)
    # the sliding windows of the model's attention layers, one per windowed layer
    window_sizes: list[int] = wire(List(Int(minimum=1)), default_factory=list)
    # Window pool (0: none, windowed layers' KV sits in the KV pool): slots for the
    # sliding-window layers' KV, booked by the scheduler per token like KV slots but
    # held only for the `window_sizes` positions before a point that needs them
    window_capacity: int = wire(Int(minimum=0), default=0)
    # the decode caches' layout (runtime/kv_layout.py): positions per decode page,
    # or 0 for the padded layout; the scheduler counts `decode_cache_tokens` by it
    decode_page: int = wire(Int(minimum=0), default=0)
    # the worker verifies draft tokens (DecodeRow.draft): it decodes in pages
    verifies_drafts: bool = wire(Bool(), default=False)
    # what one forward of n positions costs next to one, n = 1, 2, ... (measured at
    # startup, worker_proc/verify_cost.py; empty: not measured): drafts are sized by it
    verify_costs: list[float] = wire(List(Float()), default_factory=list)
    # --speculative draft: the worker holds a draft model (its name), and what one of
    # its decode steps costs next to one of the model's (measured; 0: not measured)
    draft_model: str = wire(Str(), default="")
    draft_cost: float = wire(Float(), default=0.0)
    # ranks of the tensor-parallel group this worker is (--tp; 1: a single process);
    # every figure above is one rank's (the KV of its heads), the same on each
    tensor_parallel: int = wire(Int(minimum=1), default=1)
    # stages of the pipeline-parallel group this worker is (--pp; 1: none)
    pipeline_parallel: int = wire(Int(minimum=1), default=1)
    # the worker runs grammar-constrained requests (llguidance reads its tokenizer)
    constraints: bool = wire(Bool(), default=True)
    # the disk tier (--kv-disk): on, and the entries its directory holds at start
    kv_disk: bool = wire(Bool(), default=False)
    kv_disk_entries: list[str] = wire(List(Str(max_len=128)), default_factory=list)
    # quantized KV (--kv-bits): each running request's newest positions the decode
    # attends in float (--kv-float-tail; 0: none)
    kv_float_tail: int = wire(Int(minimum=0), default=0)


@message
class WorkerReady:
    """The worker has loaded the model; sent once, before any StepResult."""

    TAG = 62
    limits: WorkerLimits = wire(Struct(WorkerLimits))
