"""Messages the MLX worker receives (from the scheduler)."""

import math

from .codec import ProtocolError
from .fields import Bool, Float, Int, List, Opt, Str, Struct, wire
from .message import message


# The repetition penalty counts this many of the latest context tokens (prompt and
# output), as mlx_lm's default does; the scheduler sends the prompt's tail that long.
REPETITION_CONTEXT = 20


@message
class SamplingParams:
    """How the worker picks a token. temperature 0 means greedy. The penalties,
    `logit_bias` (`bias_ids[i]` gets `bias_values[i]` added) and `min_tokens` change
    the logits a row samples from (worker_proc/penalties.py); each off by default.
    `grammar` (an llguidance grammar, compiled and checked by the tokenizer process)
    constrains the tokens a row may pick (worker_proc/grammar.py)."""

    temperature: float = wire(Float(), default=0.0)
    top_p: float = wire(Float(), default=1.0)
    top_k: int = wire(Int(minimum=0), default=0)
    min_p: float = wire(Float(), default=0.0)
    seed: int | None = wire(Opt(Int()), default=None)
    top_logprobs: int = wire(Int(minimum=0), default=0)
    presence_penalty: float = wire(Float(), default=0.0)
    frequency_penalty: float = wire(Float(), default=0.0)
    repetition_penalty: float = wire(Float(), default=1.0)
    bias_ids: list[int] = wire(List(Int()), default_factory=list)
    bias_values: list[float] = wire(List(Float()), default_factory=list)
    min_tokens: int = wire(Int(minimum=0), default=0)
    grammar: str | None = wire(Opt(Str()), default=None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_tokens(self) -> bool:
        """A penalty needs the tokens of the request's context."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Anything changes the logits before the token is picked."""
        return self.counts_tokens or bool(self.bias_ids) or self.min_tokens > 0

    @property
    def needs_output_ids(self) -> bool:
        """The worker rebuilds the row's state from its output so far when it resumes
        (penalty counts, the grammar's position)."""
        return self.counts_tokens or self.grammar is not None

    def check(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0
                and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1
                and all(map(math.isfinite, (self.presence_penalty, self.frequency_penalty,
                                            self.repetition_penalty, *self.bias_values)))
                and self.repetition_penalty > 0
                and len(self.bias_ids) == len(self.bias_values)):
            raise ProtocolError(f"sampling parameters out of range: {self}")


@message
class PrefillInput:
    """Prefill work for one request: a new request, a resumed one, or the next
    chunk of a chunked prompt. KV of `input_ids` goes to `new_slot_ids`;
    `prefix_slot_ids` name pool slots already holding the KV of the tokens before
    them. Only the last chunk `needs_logits`: then a token is sampled and the
    request joins the decode batch."""

    rid: int = wire(Int())
    input_ids: list[int] = wire(List(Int()))
    prefix_slot_ids: list[int] = wire(List(Int()))
    new_slot_ids: list[int] = wire(List(Int()))
    sampling: SamplingParams = wire(Struct(SamplingParams))
    needs_logits: bool = wire(Bool(), default=True)
    # tokens sampled before (a resumed request): keys the sampler
    num_generated: int = wire(Int(minimum=0), default=0)
    # Sent with the last chunk only when `sampling` needs them (empty otherwise): what
    # the penalties count, so that a resumed request's counts are rebuilt, and the ids
    # min_tokens holds back.
    prompt_tail: list[int] = wire(List(Int()), default_factory=list)
    output_ids: list[int] = wire(List(Int()), default_factory=list)
    stop_token_ids: list[int] = wire(List(Int()), default_factory=list)
    # Models with recurrent layers (state slots booked by the scheduler; 0: none): the
    # state the prefix ends at is read from `state_from` (0: the zero state of an
    # empty prefix); the state after this prefill is stored at `state_slot` and at
    # `snapshot_slot`.
    state_from: int = wire(Int(minimum=0), default=0)
    state_slot: int = wire(Int(minimum=0), default=0)
    snapshot_slot: int = wire(Int(minimum=0), default=0)
    # Models with sliding-window layers and a window pool (window slots booked by the
    # scheduler; empty lists otherwise): per prefix and per new token, the window
    # slot holding that position's window-layer KV. 0: not held (a prefix position
    # older than the window, which the window mask never reaches and which reads as
    # zeros), or not to be stored (a new token the scheduler frees at once).
    prefix_window_ids: list[int] = wire(List(Int(minimum=0)), default_factory=list)
    new_window_ids: list[int] = wire(List(Int(minimum=0)), default_factory=list)

    def check(self):
        if not self.input_ids or len(self.input_ids) != len(self.new_slot_ids):
            raise ProtocolError(f"prefill {self.rid}: input_ids and new_slot_ids must be "
                                "non-empty and of equal length")
        if self.new_window_ids and (len(self.new_window_ids) != len(self.new_slot_ids) or
                                    len(self.prefix_window_ids) != len(self.prefix_slot_ids)):
            raise ProtocolError(f"prefill {self.rid}: window ids must match the slot ids "
                                "one for one")


@message
class Step:
    """One scheduler step. The worker first drops `releases`, then decodes
    `decode_rids` (writing each one's input-token KV to its slot in
    `decode_slot_ids`), then runs `prefills`."""

    TAG = 51
    step_id: int = wire(Int())
    decode_rids: list[int] = wire(List(Int()), default_factory=list)
    decode_slot_ids: list[int] = wire(List(Int()), default_factory=list)
    prefills: list[PrefillInput] = wire(List(Struct(PrefillInput)), default_factory=list)
    releases: list[int] = wire(List(Int()), default_factory=list)
    # with a window pool: each decode row's window slot for its input token
    decode_window_ids: list[int] = wire(List(Int(minimum=0)), default_factory=list)

    def check(self):
        if len(self.decode_rids) != len(self.decode_slot_ids):
            raise ProtocolError("decode_rids and decode_slot_ids differ in length")
        if self.decode_window_ids and len(self.decode_window_ids) != len(self.decode_rids):
            raise ProtocolError("decode_rids and decode_window_ids differ in length")
