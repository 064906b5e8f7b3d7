"""Messages the MLX worker receives (from the scheduler)."""

from .codec import ProtocolError
from .fields import Bool, Int, List, Struct, wire
from .message import message
from .sampling import SamplingParams


@message
class DiskRun:
    """One entry of the disk tier (runtime/kv_disk.py names it by these): the KV of
    `n_tokens` tokens after the prefix whose hash is `parent`, up to the one whose
    hash is `end`; `resumable`: it holds what resuming at its end needs beyond KV."""

    parent: int = wire(Int())
    end: int = wire(Int())
    n_tokens: int = wire(Int(minimum=1))
    resumable: bool = wire(Bool(), default=True)


@message
class Spill:
    """Write KV the radix tree holds to the disk tier, as the entry `run`: the KV at
    `slot_ids` of its tokens `tokens`. A resumable run on a window-pool model also
    carries the window slots of the `window + 1` positions before its end
    (`window_ids`), one on a recurrent model the snapshot of the state at its end
    (`snapshot_slot`). The worker reads these slots before the Step writes any."""

    run: DiskRun = wire(Struct(DiskRun))
    tokens: list[int] = wire(List(Int()))
    slot_ids: list[int] = wire(List(Int(minimum=1)))
    window_ids: list[int] = wire(List(Int(minimum=1)), default_factory=list)
    snapshot_slot: int = wire(Int(minimum=0), default=0)

    def check(self):
        if not self.tokens or len(self.tokens) != len(self.slot_ids) or \
                len(self.tokens) != self.run.n_tokens:
            raise ProtocolError("a spill's tokens, slot ids and run differ in length")


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
    # The disk tier: the first `disk_tokens` input tokens' KV may be read from the
    # entries `disk_runs` (chained, the first starting at prefix position
    # `disk_start`) instead of computed; a recurrent model's state at their end goes
    # to `disk_state_slot`. Whatever cannot be read is computed, as if none were sent.
    disk_runs: list[DiskRun] = wire(List(Struct(DiskRun)), default_factory=list)
    disk_start: int = wire(Int(minimum=0), default=0)
    disk_tokens: int = wire(Int(minimum=0), default=0)
    disk_state_slot: int = wire(Int(minimum=0), default=0)

    def check(self):
        if not self.input_ids or len(self.input_ids) != len(self.new_slot_ids):
            raise ProtocolError(f"prefill {self.rid}: input_ids and new_slot_ids must be "
                                "non-empty and of equal length")
        if self.new_window_ids and (len(self.new_window_ids) != len(self.new_slot_ids) or
                                    len(self.prefix_window_ids) != len(self.prefix_slot_ids)):
            raise ProtocolError(f"prefill {self.rid}: window ids must match the slot ids "
                                "one for one")


@message
class DecodeRow:
    """One running request's part of a Step: decode its input token, whose KV goes to
    `slot` (with a window pool, the windowed layers' to window slot `window`).

    Speculative decoding: `draft` holds tokens proposed to follow the input; one
    forward verifies them, writing their KV at `draft_slots` (drafts are verified in
    pages only: a worker with a window pool verifies none), and the row's result is
    a run of the accepted ones and one token more (StepResult.runs). `model_draft`
    asks the worker's draft model for that many tokens instead: `draft` is then
    empty and `draft_slots` holds as many slots.

    Pages: `chain_page` is the pool page the row's next position after this Step's
    goes to where that position starts a page (0: in its input's page, or not
    booked), so a chained decode writes it where it belongs."""

    rid: int = wire(Int())
    slot: int = wire(Int())
    window: int = wire(Int(minimum=0), default=0)
    draft: list[int] = wire(List(Int()), default_factory=list)
    draft_slots: list[int] = wire(List(Int()), default_factory=list)
    model_draft: int = wire(Int(minimum=0), default=0)
    chain_page: int = wire(Int(minimum=0), default=0)

    def check(self):
        if self.model_draft and self.draft:
            raise ProtocolError(f"request {self.rid}: a row's drafts come from the "
                                "scheduler or from the worker's draft model, not both")
        if len(self.draft_slots) != (self.model_draft or len(self.draft)):
            raise ProtocolError(f"request {self.rid}: its draft and draft_slots differ "
                                "in length")

    @property
    def drafts(self) -> bool:
        return bool(self.draft or self.model_draft)


@message
class Step:
    """One scheduler step. The worker first drops `releases`, then decodes the
    `decodes` (one record per running request, DecodeRow), then runs `prefills`.

    `chain_next`: the worker may start the next decode before the next Step arrives
    (overlap); the scheduler clears it when it means to send drafts next, which a
    chained decode cannot take, or when a row's next position starts a page it
    could not book (DecodeRow.chain_page)."""

    TAG = 51
    step_id: int = wire(Int())
    decodes: list[DecodeRow] = wire(List(Struct(DecodeRow)), default_factory=list)
    prefills: list[PrefillInput] = wire(List(Struct(PrefillInput)), default_factory=list)
    releases: list[int] = wire(List(Int()), default_factory=list)
    spills: list[Spill] = wire(List(Struct(Spill)), default_factory=list)   # disk tier
    chain_next: bool = wire(Bool(), default=True)

    @property
    def decode_rids(self) -> list[int]:
        return [row.rid for row in self.decodes]

    @property
    def has_drafts(self) -> bool:
        return any(row.drafts for row in self.decodes)
