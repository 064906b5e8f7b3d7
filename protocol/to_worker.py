"""Messages the MLX worker receives (from the scheduler)."""

import math

from .codec import ProtocolError
from .fields import Bool, Float, Int, List, Opt, Struct, wire
from .message import message


@message
class SamplingParams:
    """How the worker picks a token. temperature 0 means greedy."""

    temperature: float = wire(Float(), default=0.0)
    top_p: float = wire(Float(), default=1.0)
    top_k: int = wire(Int(minimum=0), default=0)
    min_p: float = wire(Float(), default=0.0)
    seed: int | None = wire(Opt(Int()), default=None)
    top_logprobs: int = wire(Int(minimum=0), default=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0
                and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1):
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

    def check(self):
        if not self.input_ids or len(self.input_ids) != len(self.new_slot_ids):
            raise ProtocolError(f"prefill {self.rid}: input_ids and new_slot_ids must be "
                                "non-empty and of equal length")


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

    def check(self):
        if len(self.decode_rids) != len(self.decode_slot_ids):
            raise ProtocolError("decode_rids and decode_slot_ids differ in length")
