"""Messages the MLX worker receives (from the scheduler)."""

import math
from dataclasses import dataclass, field

from .codec import (
    ProtocolError, expect_bool, expect_float, expect_int, expect_int_list,
    expect_len, expect_list, optional,
)


@dataclass(slots=True)
class SamplingParams:
    """How the worker picks a token. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_wire(self):
        return [self.temperature, self.top_p, self.top_k, self.min_p, self.seed,
                self.top_logprobs]

    @classmethod
    def from_wire(cls, f):
        expect_list(f, "sampling")
        expect_len(f, 6, "SamplingParams")
        params = cls(
            expect_float(f[0], "temperature"), expect_float(f[1], "top_p"),
            expect_int(f[2], "top_k", 0), expect_float(f[3], "min_p"),
            optional(expect_int, f[4], "seed"), expect_int(f[5], "top_logprobs", 0))
        if not (math.isfinite(params.temperature) and params.temperature >= 0
                and 0 < params.top_p <= 1 and 0 <= params.min_p <= 1):
            raise ProtocolError(f"sampling parameters out of range: {params}")
        return params


@dataclass(slots=True)
class PrefillInput:
    """Prefill work for one request: a new request, a resumed one, or the next
    chunk of a chunked prompt. KV of `input_ids` goes to `new_slot_ids`;
    `prefix_slot_ids` name pool slots already holding the KV of the tokens before
    them. Only the last chunk `needs_logits`: then a token is sampled and the
    request joins the decode batch."""

    rid: int
    input_ids: list[int]
    prefix_slot_ids: list[int]
    new_slot_ids: list[int]
    sampling: SamplingParams
    needs_logits: bool = True
    num_generated: int = 0   # tokens sampled before (a resumed request): keys the sampler

    def to_wire(self):
        return [self.rid, self.input_ids, self.prefix_slot_ids, self.new_slot_ids,
                self.sampling.to_wire(), self.needs_logits, self.num_generated]

    @classmethod
    def from_wire(cls, f):
        expect_list(f, "prefill")
        expect_len(f, 7, "PrefillInput")
        p = cls(expect_int(f[0], "rid"), expect_int_list(f[1], "input_ids"),
                expect_int_list(f[2], "prefix_slot_ids"),
                expect_int_list(f[3], "new_slot_ids"),
                SamplingParams.from_wire(f[4]), expect_bool(f[5], "needs_logits"),
                expect_int(f[6], "num_generated", 0))
        if not p.input_ids or len(p.input_ids) != len(p.new_slot_ids):
            raise ProtocolError(f"prefill {p.rid}: input_ids and new_slot_ids must be "
                                "non-empty and of equal length")
        return p


@dataclass(slots=True)
class Step:
    """One scheduler step. The worker first drops `releases`, then decodes
    `decode_rids` (writing each one's input-token KV to its slot in
    `decode_slot_ids`), then runs `prefills`."""

    TAG = 51
    step_id: int
    decode_rids: list[int] = field(default_factory=list)
    decode_slot_ids: list[int] = field(default_factory=list)
    prefills: list[PrefillInput] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)

    def to_wire(self):
        return [self.step_id, self.decode_rids, self.decode_slot_ids,
                [p.to_wire() for p in self.prefills], self.releases]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 5, "Step")
        step = cls(expect_int(f[0], "step_id"), expect_int_list(f[1], "decode_rids"),
                   expect_int_list(f[2], "decode_slot_ids"),
                   [PrefillInput.from_wire(p) for p in expect_list(f[3], "prefills")],
                   expect_int_list(f[4], "releases"))
        if len(step.decode_rids) != len(step.decode_slot_ids):
            raise ProtocolError("decode_rids and decode_slot_ids differ in length")
        return step
