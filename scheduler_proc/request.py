"""A request as the scheduler sees it: token ids, budget, KV slots, status."""

import enum
from dataclasses import dataclass, field

from protocol import SamplingParams, TokenizedRequest


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    slot_ids: list[int] = field(default_factory=list)   # KV slots sent to the worker
    status: Status = Status.WAITING

    @classmethod
    def from_message(cls, msg: TokenizedRequest, max_new_tokens: int) -> "Request":
        return cls(msg.rid, msg.input_ids, msg.sampling, max_new_tokens,
                   frozenset(msg.stop_token_ids))

    @property
    def kv_need(self) -> int:
        """Slots this request may hold at most: every token but the last has KV."""
        return len(self.prompt_ids) + self.max_new_tokens - 1

    @property
    def kv_outstanding(self) -> int:
        return self.kv_need - len(self.slot_ids)

    def finish_reason_after(self, token: int) -> str | None:
        if token in self.stop_token_ids:
            return "stop"
        if len(self.output_ids) >= self.max_new_tokens:
            return "length"
        return None

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.output_ids), "cached_tokens": 0}
