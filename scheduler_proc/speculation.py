"""Speculative decoding, the scheduler's side: which rows draft, what, and how far.

A decoding row may send draft tokens with its input (DecodeRow.draft): the worker
verifies them in one forward and returns a run of the accepted ones and one token
more. The scheduler proposes the drafts (n-gram drafts: the continuation of the
row's longest recent n-gram match in its own prompt and output, `ngram.NgramIndex`),
books a KV slot for each draft token beside the input's, and frees those of the
rejected ones when the run comes back. A row's draft length follows its recent
acceptance (`ngram.DraftLength`); a row whose drafts keep failing pauses.

Drafts need a worker that verifies them (WorkerLimits.verifies_drafts) and a Step
the worker did not start ahead: with overlap, the worker chains the next decode
after a Step whose `chain_next` is set, and a chained decode takes no drafts. So
a Step clears `chain_next` while any of its rows has a proposal (the next Step can
then carry drafts), and sets it when none has, keeping the overlap where drafting
finds nothing. No drafts while more rows decode than `max_batch`.

Drafts are sized by what they cost (`plan_lengths`): the worker measures, at startup,
what one forward of n positions costs next to one (WorkerLimits.verify_costs), and
each row has an estimate of how likely its next draft token is accepted
(`Acceptance`); the Step's drafts are the lengths that give the most expected tokens
per unit of forward cost, and none unless that beats decoding without them. Where
verifying is nearly free (a GPU, a memory-bound CPU) long drafts go out; where it is
compute-bound only rows whose drafts are reliably accepted draft at all.
"""

from dataclasses import dataclass, field
from typing import Callable

from .ngram import DraftLength, NgramIndex
from .request import Request

METHODS = ("off", "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"       # "off", "ngram" or "draft" (the worker's draft model)
    max_draft: int = 8        # draft tokens per row and step
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 8        # no drafts above this many decoding rows

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} "
                             "(off, ngram or draft)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("the n-gram draft lengths need 1 <= min <= max, got "
                             f"{self.ngram_min} and {self.ngram_max}")

    @property
    def on(self) -> bool:
        return self.method != "off"


MARGIN = 0.03   # drafts go out only for an expected gain above this
MODEL_DRAFT = -1   # a proposal's token the worker's draft model is asked for
# A Step with drafts is not chained (nor is the one before it): on a worker that
# overlaps, its forward costs this much more than the curve says (what overlap saves
# a step, bench/overhead.py: ~0.93 vs ~0.85 of in-process decode on the default model)
UNCHAINED_COST = 0.1


class Acceptance:
    """How likely a row's next draft token is accepted (given the ones before it):
    accepted positions over tried ones, recent verifies weighing most, from a prior
    of PRIOR worth STRENGTH positions (optimistic: a row's first drafts go out). A
    step whose proposal is held back (`held`) fades the misses a little, so a row that
    stopped drafting tries again now and then (its text may have turned repetitive)."""

    PRIOR, STRENGTH, DECAY, FADE = 0.9, 2.0, 0.7, 0.97

    def __init__(self):
        self.hits = 0.0     # draft tokens accepted (decayed)
        self.misses = 0.0   # draft tokens refused, one per verify at most (decayed)

    @property
    def rate(self) -> float:
        return (self.hits + self.PRIOR * self.STRENGTH) / (
            self.hits + self.misses + self.STRENGTH)

    def record(self, proposed: int, accepted: int) -> None:
        self.hits = self.hits * self.DECAY + accepted
        self.misses = self.misses * self.DECAY + (1 if accepted < proposed else 0)

    def held(self) -> None:
        self.misses *= self.FADE


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify of k draft tokens gives, each accepted with probability `rate`
    after the ones before it: 1 + rate + ... + rate^k."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def cost_of(curve: list[float]) -> Callable[[int], float]:
    """The cost of a forward of n positions from the worker's curve (`curve[n - 1]`),
    linear beyond its end."""
    def cost(n: int) -> float:
        if n <= len(curve):
            return curve[n - 1]
        slope = curve[-1] - curve[-2] if len(curve) > 1 else 1.0
        return curve[-1] + slope * (n - len(curve))
    return cost


def plan_lengths(most: list[int], rates: list[float], rows: int,
                 cost: Callable[[int], float], unchained: float = 0.0,
                 replays: bool = False, drafting: float = 0.0) -> list[int]:
    """Draft lengths (each at most `most[i]`) for a decode of `rows` rows that
    maximise expected tokens per unit of forward cost; all 0 unless that beats no
    drafts by MARGIN. The verify's forward is rectangular, every row as wide as the
    longest draft plus one, so its cost is set by that width w: `cost(rows * (1 + w))`,
    and at a given width every row does best drafting all it may up to w (a longer
    draft never gives fewer expected tokens). So the best plan is the best width.
    `unchained`: what a Step with drafts costs beyond that, as a share (it loses the
    overlap of a chained decode). `replays`: the model has recurrent state, and a
    verify whose rows drop positions runs a second forward of at most that width to
    recompute the states of the kept ones (counted at its most). `drafting`: what a
    draft model's forward of the rows costs next to the model's (0: drafts cost
    nothing to make); w tokens take w more of them than a step without drafts."""
    def value(w: int) -> float:
        tokens = rows + sum(expected_tokens(a, min(m, w)) - 1.0 for m, a in zip(most, rates))
        if not w:
            return tokens / cost(rows)
        forward = cost(rows * (1 + w))
        return tokens / (forward * (1.0 + unchained) + (forward if replays else 0.0)
                         + drafting * w * cost(rows))

    width = max(range(max(most, default=0) + 1), key=value)
    if value(width) <= value(0) * (1.0 + MARGIN):
        return [0] * len(most)
    return [min(m, width) for m in most]


class Drafter:
    """One request's drafts: its token index (n-gram drafts), its draft length, its
    acceptance."""

    def __init__(self, req: Request, config: SpecConfig):
        self.index = (NgramIndex(req.prompt_ids, config.ngram_min, config.ngram_max)
                      if config.method == "ngram" else None)
        self.prompt_len = len(req.prompt_ids)
        self.length = DraftLength(config.max_draft)
        self.acceptance = Acceptance()

    def propose(self, req: Request, most: int) -> list[int]:
        """At most `most` tokens to follow the request's prompt and output so far
        (the index takes the output it has not seen); counts one step of a pause.
        With the worker's draft model, as many placeholders (MODEL_DRAFT) as tokens
        to ask it for."""
        k = min(self.length.next(), most)
        if self.index is None:
            return [MODEL_DRAFT] * max(k, 0)
        self.index.extend(req.output_ids[len(self.index) - self.prompt_len:])
        return self.index.propose(k) if k > 0 else []


@dataclass
class SpecCounters:
    """What speculation did (stats, metrics): row-steps that verified a draft, draft
    tokens sent, draft tokens accepted."""

    method: str = "off"
    verifies: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def as_dict(self) -> dict:
        return {"method": self.method, "verifies": self.verifies,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}


@dataclass
class Speculation:
    """The drafts of each Step and what came of them."""

    config: SpecConfig
    verifies_drafts: bool = False   # the worker's WorkerLimits.verifies_drafts
    verify_costs: list[float] = field(default_factory=list)   # WorkerLimits' (empty: free)
    worker_overlaps: bool = False   # drafts then cost the chained decode's overlap
    replays: bool = False   # recurrent states: a verify that drops positions replays them
    draft_model: bool = False   # the worker holds a draft model (WorkerLimits.draft_model)
    draft_cost: float = 0.0     # its forward next to the model's (WorkerLimits')
    counters: SpecCounters = field(default_factory=SpecCounters)
    drafters: dict[int, Drafter] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)   # rid -> draft tokens in flight

    def __post_init__(self):
        self.counters.method = self.config.method if self.usable else "off"

    @property
    def usable(self) -> bool:
        return self.config.on and self.verifies_drafts and (
            self.config.method != "draft" or self.draft_model)

    @property
    def by_model(self) -> bool:
        """The drafts are the worker's draft model's (DecodeRow.model_draft)."""
        return self.config.method == "draft"

    def proposals(self, rows: list[Request]) -> list[list[int]]:
        """Each row's draft now (empty: none), at most what its remaining tokens leave
        room for after the run's last token; none above `max_batch` rows."""
        if not self.usable or len(rows) > self.config.max_batch:
            return [[] for _ in rows]
        proposals = [self._proposal(r) for r in rows]
        if not self.verify_costs or not any(proposals):
            return proposals
        rates = [self.drafters[r.rid].acceptance.rate if p else 0.0
                 for r, p in zip(rows, proposals)]
        ks = plan_lengths([len(p) for p in proposals], rates, len(rows),
                          cost_of(self.verify_costs),
                          UNCHAINED_COST if self.worker_overlaps else 0.0, self.replays,
                          self.draft_cost)
        for r, p, k in zip(rows, proposals, ks):
            if p and not k:
                self.drafters[r.rid].acceptance.held()
        return [p[:k] for p, k in zip(proposals, ks)]

    def _proposal(self, req: Request) -> list[int]:
        if not drafts_allowed(req):
            return []
        most = req.max_new_tokens - len(req.output_ids) - 1
        if most <= 0:
            return []
        drafter = self.drafters.get(req.rid)
        if drafter is None:
            drafter = self.drafters[req.rid] = Drafter(req, self.config)
        return drafter.propose(req, most)

    def sending(self, req: Request, draft: list[int]) -> None:
        self.sent[req.rid] = len(draft)
        self.counters.verifies += 1
        self.counters.draft_tokens += len(draft)

    def ran(self, req: Request, run: int) -> int:
        """The row's run of `run` tokens came back: its accepted draft tokens (0 for a
        row that sent none)."""
        sent = self.sent.pop(req.rid, 0)
        if not sent:
            return 0
        accepted = min(run - 1, sent)
        self.counters.accepted_tokens += accepted
        drafter = self.drafters.get(req.rid)
        if drafter is not None:
            drafter.length.record(sent, accepted)
            drafter.acceptance.record(sent, accepted)
        return accepted

    def forget(self, rid: int) -> None:
        """The request finished: its index goes."""
        self.drafters.pop(rid, None)
        self.sent.pop(rid, None)

    def reset(self) -> None:
        """Nothing is in flight (the worker dropped its state)."""
        self.sent.clear()


def drafts_allowed(req: Request) -> bool:
    """Rows under a thinking budget draft nothing (its count follows one token at a
    time). A constrained row drafts: the worker masks each draft position as the
    row's grammar would be there, and cuts the draft at a token the grammar refuses."""
    return req.sampling.thinking_budget is None
