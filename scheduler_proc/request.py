"""A request as the scheduler sees it: token ids, budget, KV slots, status."""

import enum
from dataclasses import dataclass, field

from mlxd.protocol import Pin, SamplingParams, TokenizedRequest, Usage


class Status(enum.Enum):
    WAITING = 0
    PREFILLING = 1   # running; the worker has no decode row for it until its last piece
    RUNNING = 2      # running, in the decode batch
    FINISHED = 3


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    # KV of all_ids[:len(slot_ids)]: its progress, the one number of how far its KV
    # goes (booked for the step in flight included); written by KVBook only
    slot_ids: list[int] = field(default_factory=list)
    prefix_len: int = 0          # leading slots owned by the radix tree (locked)
    # window (position // page) -> the pool page this request took for it (allocator.py)
    own_pages: dict[int, int] = field(default_factory=dict)
    # window-pool models (KVBook writes these): per position, its window slot (0:
    # none held); private ones before `window_floor` were freed already
    window_ids: list[int] = field(default_factory=list)
    window_floor: int = 0
    last_node: object = None     # the tree node this request's lock ends at
    # recurrent-state models (KVBook writes these): its working state slot (0: none),
    # the slot holding the state its KV ends at, and the snapshot its prefill in
    # flight writes (the tree takes it when that KV is cached)
    state_slot: int = 0
    state_from: int = 0
    pending_snapshot: int = 0
    cached_tokens: int | None = None   # prefix reused at the first admission
    disk_tokens: int = 0         # of those, read from the disk tier
    hashes: list[int] = field(default_factory=list)   # block hashes of all_ids[:hash_key]
    hash_key: int = 0
    status: Status = Status.WAITING
    retractions: int = 0
    arrival: int = 0             # its number in the waiting queue's arrival order
    overtaken: int = 0           # later arrivals admitted while this one waited (LPM order)
    # the waiting queue's cached-prefix match, kept until the tree changes
    match_key: tuple = ()        # (tree version, num_tokens) when match_len was computed
    match_len: int = 0           # cached prefix length of all_ids[:-1]
    match_node: object = None    # the tree node that prefix ends at
    # cache_control: prefixes to pin once the tree holds them (KVBook takes them)
    pins: list[Pin] = field(default_factory=list)
    pinned_tokens: int = 0       # prompt tokens it computed and pinned
    accepted_tokens: int = 0     # of its output, draft tokens verified (speculation)
    resumes: int = 0             # times it went on after a process running it died
    report_usage: bool = False   # send usage with its next tokens (resumed: a new count)

    @classmethod
    def from_message(cls, msg: TokenizedRequest, max_new_tokens: int) -> "Request":
        req = cls(msg.rid, msg.input_ids, msg.sampling, max_new_tokens,
                  frozenset(msg.stop_token_ids), output_ids=list(msg.output_ids),
                  resumes=msg.resumes)
        req.pins = sorted(msg.pin, key=lambda p: p.offset)
        req.report_usage = msg.resumes > 0   # the front end learns its count anew
        return req

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(all_ids), without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def behind(self) -> int:
        """Tokens it has and whose KV is not booked yet: what it has to catch up
        (its input while it prefills; 1 in a decode, the token just sampled)."""
        return self.num_tokens - len(self.slot_ids)

    @property
    def prefilling(self) -> bool:
        """Running, still computing the KV of its input (possibly piece by piece)."""
        return self.status is Status.PREFILLING

    @property
    def running(self) -> bool:
        return self.status is Status.PREFILLING or self.status is Status.RUNNING

    def finish_reason_after(self, token: int) -> str | None:
        if token in self.stop_token_ids:
            return "stop"
        if len(self.output_ids) >= self.max_new_tokens:
            return "length"
        return None

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.output_ids),
                     cached_tokens=self.cached_tokens or 0, disk_tokens=self.disk_tokens,
                     pinned_tokens=self.pinned_tokens,
                     accepted_tokens=self.accepted_tokens, resumes=self.resumes)
