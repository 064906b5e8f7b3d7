"""A thinking budget: a reasoning model thinks at most `thinking_budget` tokens, then
the end of its think block is forced, token by token, and the answer follows.

The tokenizer sets the markers' token ids (`think_start_ids`, `think_end_ids`) and
whether the prompt already opened the block (`think_opened`). A row's state follows
the tokens it keeps (read back each step, as a grammar's): before the block, a
reply that does not start with the start marker does not think and is never cut;
inside it, the tokens are counted, and the end marker written by the model ends it;
at the budget the end marker is forced, continuing a part of it the model had just
begun. Rows under a live budget are not decoded ahead of their tokens being read
(model_runner's `_builds_ahead`), so the count is never a step late.
"""

from dataclasses import dataclass, field

import mlx.core as mx

from mlxd.protocol import SamplingParams

BEFORE, THINKING, DONE = "before", "thinking", "done"


@dataclass
class ThinkBudget:
    budget: int
    start_ids: list[int]
    end_ids: list[int]
    phase: str = BEFORE
    count: int = 0           # tokens thought so far
    forced: int = 0          # end-marker tokens forced (or continued) so far
    tail: list[int] = field(default_factory=list)   # the latest tokens, for the markers

    @classmethod
    def of(cls, params: SamplingParams, output_ids=()) -> "ThinkBudget | None":
        """The row's budget (None: it has none), its state after `output_ids` (a
        request resumed after a retraction)."""
        if params.thinking_budget is None or not params.think_end_ids:
            return None
        phase = THINKING if params.think_opened or not params.think_start_ids else BEFORE
        row = cls(params.thinking_budget, list(params.think_start_ids),
                  list(params.think_end_ids), phase)
        for token in output_ids:
            row.advance(token)
        return row

    @property
    def live(self) -> bool:
        return self.phase != DONE

    def next_forced(self) -> int | None:
        """The token the row's next sample must be, if the budget forces one."""
        if self.phase != THINKING or self.count < self.budget:
            return None
        if not self.forced:   # continue an end marker the model has just begun
            self.forced = _begun(self.tail, self.end_ids)
        return self.end_ids[self.forced]

    def advance(self, token: int) -> None:
        """The row kept `token`."""
        if self.phase == DONE:
            return
        if self.phase == THINKING and self.count >= self.budget:   # a forced token
            self.next_forced()   # where the forced marker starts (a resumed row's too)
            self.forced += 1
            self._push(token)
            if self.forced >= len(self.end_ids):
                self.phase = DONE
            return
        self._push(token)
        if self.phase == BEFORE:
            n = len(self.tail)
            if self.tail != self.start_ids[:n]:
                self.phase = DONE   # it answers without thinking
            elif n == len(self.start_ids):
                self.phase, self.tail = THINKING, []
            return
        self.count += 1
        if self.tail[-len(self.end_ids):] == self.end_ids:
            self.phase = DONE

    def _push(self, token: int) -> None:
        self.tail = (self.tail + [token])[-max(len(self.start_ids), len(self.end_ids)):]


def _begun(tail: list[int], marker: list[int]) -> int:
    """How many of `marker`'s first tokens `tail` ends with (fewer than all)."""
    for n in range(min(len(tail), len(marker) - 1), 0, -1):
        if tail[-n:] == marker[:n]:
            return n
    return 0


def forced_tokens(budgets: list["ThinkBudget | None"]) -> list[int | None] | None:
    """Per row, the token its budget forces; None when no row's does."""
    forced = [b.next_forced() if b is not None else None for b in budgets]
    return forced if any(f is not None for f in forced) else None


def force(allowed: mx.array | None, forced: list[int | None], vocab: int) -> mx.array:
    """The [rows, vocab] mask allowing only the forced token on rows that have one,
    and what `allowed` allows (everything, when None) on the others."""
    ids = mx.array([-1 if f is None else f for f in forced])[:, None]
    only = mx.arange(vocab)[None, :] == ids
    free = allowed if allowed is not None else mx.ones((len(forced), vocab), mx.bool_)
    return mx.where(ids < 0, free, only)
