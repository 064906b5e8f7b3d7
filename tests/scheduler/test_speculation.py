"""The scheduler's side of speculative decoding, against a scripted worker: which rows
draft, the slots drafts book and give back, chain_next, the budget and the counters.

Prompts repeat a block of ids, and the scripted worker continues the block, so the
n-gram drafter proposes the block's next tokens; a test decides per step how many of
them the "worker" accepts."""

import pytest

from mlxd.protocol import SamplingParams, Step, StepResult, TokenizedRequest
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.scheduler_proc.speculation import SpecConfig

BLOCK = list(range(10, 22))
EOS = 2


def follow(ids: list[int]) -> int:
    """The block's token after the last of `ids` (the block's first after any other)."""
    last = ids[-1]
    return BLOCK[(BLOCK.index(last) + 1) % len(BLOCK)] if last in BLOCK else BLOCK[0]


def make(spec: SpecConfig = SpecConfig("ngram"), verifies: bool = True,
         overlaps: bool = False, **limits) -> Scheduler:
    limits.setdefault("kv_capacity", 512)
    return Scheduler(SchedulerLimits(max_context=1000, decode_page=16, speculative=spec,
                                     verifies_drafts=verifies, worker_overlaps=overlaps,
                                     **limits))


def add(s: Scheduler, rid: int, prompt=None, max_new: int = 40, sampling=None,
        stop=(EOS,)) -> None:
    prompt = BLOCK * 3 if prompt is None else prompt
    s.add_request(TokenizedRequest(rid, list(prompt), sampling or SamplingParams(),
                                   max_new, list(stop)))


def answer(s: Scheduler, step: Step, accept: dict | None = None,
           runs: dict | None = None) -> StepResult:
    """The scripted worker's result: each decode row's draft tokens (all, or the first
    `accept[rid]`) and the block's next token after them, or `runs[rid]` as given;
    each prefill that needs logits one token. Fed to the scheduler."""
    rids, tokens, lengths = [], [], []
    for row in step.decodes:
        rid, draft = row.rid, row.draft
        if runs and rid in runs:
            run = runs[rid]
        elif rid not in s.running:   # aborted while the step ran
            run = draft + [BLOCK[0]]
        else:
            req = s.running[rid]
            keep = draft[:accept.get(rid, len(draft))] if accept else draft
            run = keep + [follow(req.all_ids + keep)]
        rids.append(rid)
        tokens += run
        lengths.append(len(run))
    for p in step.prefills:
        if p.needs_logits:
            rids.append(p.rid)
            tokens.append(follow(s.running[p.rid].all_ids))
            lengths.append(1)
    result = StepResult(step.step_id, rids, tokens, [0.0] * len(tokens), runs=lengths)
    result.check()
    s.process_result(result)
    s.check_integrity()
    return result


def assert_whole(s: Scheduler) -> None:
    """Every slot free, cached, or held privately by a running request, once."""
    s.check_integrity()
    cached = len(s.kv.tree.all_slots()) if s.kv.tree else 0
    private = sum(len(r.slot_ids) - r.prefix_len for r in s.running.values())
    assert s.kv.allocator.num_unheld + cached + private == s.limits.kv_capacity


def until_drafting(s: Scheduler, most: int = 20) -> Step:
    """Steps (answered) until one carries drafts; that one, unanswered."""
    for _ in range(most):
        step = s.schedule()
        assert step is not None
        if step.has_drafts:
            return step
        answer(s, step)
    raise AssertionError("no Step with drafts")


def outputs(s: Scheduler) -> dict:
    out = {}
    for entry in s.take_outputs():
        got = out.setdefault(entry.rid, {"tokens": [], "final": None})
        got["tokens"] += entry.token_ids
        if entry.finish_reason:
            got["final"] = entry
    return out


# ---- slots --------------------------------------------------------------------------

@pytest.mark.parametrize("accepted", [0, 1, 2, 4])
def test_drafts_book_one_slot_per_token_and_rejected_ones_go_back(accepted):
    s = make()
    add(s, 1)
    step = until_drafting(s)
    req = s.running[1]
    draft = step.decodes[0].draft
    assert len(draft) == 4 and accepted <= len(draft)
    assert draft == [follow(req.all_ids + draft[:j]) for j in range(len(draft))]
    assert len(step.decodes[0].draft_slots) == len(draft)
    assert len(req.slot_ids) == len(req.all_ids) + len(draft)   # input's slot + the draft's
    assert not set(step.decodes[0].draft_slots) & {row.slot for row in step.decodes}
    free_before = s.kv.allocator.num_unheld
    answer(s, step, accept={1: accepted})
    assert len(req.output_ids) >= accepted + 1
    assert len(req.slot_ids) == len(req.all_ids) - 1
    assert s.kv.allocator.num_unheld == free_before + len(draft) - accepted
    assert set(step.decodes[0].draft_slots[accepted:]).isdisjoint(req.slot_ids)
    if accepted:   # the accepted tokens keep their slots; the run's last has none yet
        assert req.slot_ids[-accepted:] == step.decodes[0].draft_slots[:accepted]
    assert_whole(s)


def test_abort_while_a_draft_step_is_in_flight_frees_its_slots():
    s = make()
    add(s, 1)
    add(s, 2, prompt=[300 + i for i in range(20)])
    step = until_drafting(s)
    assert 1 in step.decode_rids
    drafted = [row.draft_slots for row in step.decodes if row.draft_slots]
    free = s.kv.allocator.num_unheld
    held = len(s.running[1].slot_ids) - s.running[1].prefix_len
    s.abort(1)
    assert_whole(s)
    assert drafted and s.kv.allocator.num_unheld >= free + len(drafted[0])
    assert s.kv.allocator.num_unheld + (len(s.kv.tree.all_slots()) if s.kv.tree else 0) \
        >= free + held
    answer(s, step)   # the result still names the aborted row: ignored
    assert 1 not in s.running
    assert_whole(s)
    while (step := s.schedule()) is not None:
        answer(s, step)
    assert_whole(s)


@pytest.mark.parametrize("at", [0, 1, 4])
def test_a_stop_token_inside_a_run_ends_the_row_there(at):
    """The whole draft [11, 12, 13, 14] accepted and 15 after it; a stop token at
    run position `at` keeps the run up to it (4: the worker's own last token)."""
    stop = BLOCK[2 + at - 1] if at else BLOCK[1]
    s = make()
    add(s, 1, stop=(EOS, stop))
    step = until_drafting(s)
    s.take_outputs()
    draft = step.decodes[0].draft
    assert draft == BLOCK[1:5]
    before = len(s.running[1].output_ids)
    answer(s, step)
    got = outputs(s)[1]
    kept = (draft + [BLOCK[5]])[:at + 1]
    assert got["tokens"] == kept
    final = got["final"]
    assert final.finish_reason == "stop"
    assert final.usage.completion_tokens == before + len(kept)
    assert final.usage.accepted_tokens == min(len(kept), len(draft))
    assert s.stats()["speculative"]["accepted_tokens"] == len(draft)
    assert 1 not in s.running
    assert_whole(s)


def test_max_new_tokens_caps_the_draft_and_ends_the_run():
    s = make()
    add(s, 1, max_new=5)
    seen = []
    while (step := s.schedule()) is not None:
        if step.decode_rids:
            req = s.running[1]
            seen.append(len(step.decodes[0].draft))
            assert seen[-1] <= req.max_new_tokens - len(req.output_ids) - 1
        answer(s, step)
    assert any(seen)
    got = outputs(s)[1]
    assert len(got["tokens"]) == 5
    assert got["final"].finish_reason == "length"
    assert got["final"].usage.completion_tokens == 5
    assert_whole(s)


def test_a_run_past_the_budget_is_cut_at_max_new_tokens():
    s = make()
    add(s, 1, max_new=4)
    step = until_drafting(s)
    s.take_outputs()
    req = s.running[1]
    left = req.max_new_tokens - len(req.output_ids)
    answer(s, step, runs={1: [follow(req.all_ids)] * (left + 2)})
    got = outputs(s)[1]
    assert len(got["tokens"]) == left
    assert got["final"].finish_reason == "length"
    assert_whole(s)


# ---- which Steps carry drafts ------------------------------------------------------------

def test_chain_next_is_cleared_while_a_row_has_a_proposal():
    """A repeating row (proposals) finishing before a row that repeats nothing."""
    s = make()
    add(s, 1, max_new=10)
    add(s, 2, prompt=[300 + i for i in range(20)], max_new=30)
    seen = set()
    while (step := s.schedule()) is not None:
        if step.decode_rids:
            assert step.chain_next is (not step.has_drafts)
            seen.add(step.chain_next)
        answer(s, step)
    assert seen == {True, False}
    assert s.stats()["speculative"]["verifies"] > 0


@pytest.mark.parametrize("overlaps", [False, True])
def test_no_drafts_right_after_a_chained_step(overlaps):
    """A row that repeats nothing (chain_next set) until its output makes an n-gram
    match: with an overlapping worker, the Step after the chained one has no drafts
    (the worker started that decode already); the Step after that has them."""
    s = make(overlaps=overlaps)
    prompt = [100, 101, 102, 103, 104, 105]
    add(s, 1, prompt=prompt)
    scripted = iter([7, 100, 101, 102, 103, 104, 105])
    steps = []
    while len(steps) < 5:
        step = s.schedule()
        steps.append(step)
        rid_runs = None
        if step.decode_rids:
            draft = step.decodes[0].draft
            rid_runs = {1: draft + [next(scripted)]} if not draft else None
        if step.prefills:
            result = StepResult(step.step_id, [1], [next(scripted)], [0.0])
            s.process_result(result)
            s.check_integrity()
        else:
            answer(s, step, runs=rid_runs)
    # steps: prefill (->7), decode 7 (->100), decode 100 (->101): no proposal yet
    assert all(st.chain_next for st in steps[:3]) and not any(st.has_drafts for st in steps[:3])
    # decode 101: [100, 101] matches the prompt's start
    assert steps[3].chain_next is False
    assert steps[3].has_drafts is (not overlaps)
    if overlaps:   # the Step after a draftless, unchained one carries the drafts
        assert not steps[3].chain_next and steps[4].has_drafts


def test_no_drafts_above_max_batch_rows():
    s = make(spec=SpecConfig("ngram", max_batch=2))
    for rid in range(3):
        add(s, rid, max_new=12)
    wide = 0
    while (step := s.schedule()) is not None:
        if len(step.decode_rids) > 2:
            wide += 1
            assert not step.has_drafts and not any(row.draft_slots for row in step.decodes)
            assert step.chain_next
        answer(s, step)
    assert wide > 0


def test_no_drafts_when_free_slots_are_short():
    """Two rows of 46 prompt slots and a decode slot each, in pages of 16, take 6
    of a pool's 7 pages: their drafts of 4 would start a page each, and one is
    free; no draft goes."""
    s = make(kv_capacity=112, disable_radix_cache=True, decode_headroom=2)
    add(s, 1, prompt=BLOCK * 3 + BLOCK[:10], max_new=8)
    add(s, 2, prompt=BLOCK * 3 + BLOCK[:10], max_new=8)
    step = s.schedule()
    assert len(step.prefills) == 2
    answer(s, step)
    step = s.schedule()
    assert step.decode_rids == [1, 2]
    assert s.kv.allocator.num_free == 16
    assert not step.has_drafts and not any(row.draft_slots for row in step.decodes)
    answer(s, step)
    assert s.stats()["speculative"]["verifies"] == 0
    assert_whole(s)


@pytest.mark.parametrize("spec, verifies", [(SpecConfig("off"), True),
                                            (SpecConfig("ngram"), False)])
def test_no_drafts_without_speculation_or_a_verifying_worker(spec, verifies):
    s = make(spec=spec, verifies=verifies)
    add(s, 1, max_new=20)
    while (step := s.schedule()) is not None:
        assert not step.has_drafts and not any(row.draft_slots for row in step.decodes)
        answer(s, step)
    assert s.stats()["speculative"] == {"method": "off", "verifies": 0, "draft_tokens": 0,
                                        "accepted_tokens": 0}


def test_thinking_rows_never_draft():
    s = make()
    add(s, 1, max_new=20, sampling=SamplingParams(thinking_budget=8))
    add(s, 2, max_new=20)
    while (step := s.schedule()) is not None:
        for rid, draft in ((row.rid, row.draft) for row in step.decodes):
            assert rid != 1 or not draft
        answer(s, step)
    assert s.stats()["speculative"]["verifies"] > 0   # the free row did draft


def test_constrained_rows_draft():
    """The worker masks each draft position by the row's grammar: a constrained row
    drafts like any other."""
    s = make()
    add(s, 1, max_new=20, sampling=SamplingParams(grammar="start: /[a-z]+/"))
    drafted = 0
    while (step := s.schedule()) is not None:
        drafted += sum(len(row.draft) for row in step.decodes if row.rid == 1)
        answer(s, step)
    assert drafted > 0


# ---- counters ----------------------------------------------------------------------

def test_usage_and_stats_counters_add_up():
    s = make()
    for rid in range(3):
        add(s, rid, prompt=BLOCK * 3 + BLOCK[:rid], max_new=30)
    sent, verifies, k = 0, 0, 0
    finals = {}
    while (step := s.schedule()) is not None:
        for draft in (row.draft for row in step.decodes):
            sent += len(draft)
            verifies += bool(draft)
        # accept a varying share of each draft
        k += 1
        answer(s, step, accept={rid: k % 4 for rid in step.decode_rids})
        for rid, got in outputs(s).items():
            if got["final"]:
                finals[rid] = got["final"]
    c = s.stats()["speculative"]
    assert c["method"] == "ngram"
    assert c["draft_tokens"] == sent and c["verifies"] == verifies
    assert c["verifies"] > 0 and c["accepted_tokens"] > 0
    assert sum(f.usage.accepted_tokens for f in finals.values()) == c["accepted_tokens"]
    assert all(f.usage.completion_tokens == 30 for f in finals.values())
    assert_whole(s)


# ---- drafts sized by the worker's measured cost ----------------------------------------

STEEP_COSTS = tuple(float(n) ** 0.8 for n in range(1, 65))   # verifying 8 costs 5.3x one


def drafts_of(s: Scheduler, accept: int | None = None, steps: int = 12) -> list[int]:
    """Draft lengths of the rows' Steps, answered accepting `accept` tokens (None: all)."""
    lengths = []
    for _ in range(steps):
        step = s.schedule()
        if step is None:
            break
        lengths.append(sum(len(row.draft) for row in step.decodes))
        answer(s, step, None if accept is None else {r: accept for r in step.decode_rids})
        s.take_outputs()
        s.check_integrity()
    return lengths


def test_a_steep_cost_curve_sends_drafts_only_while_they_are_accepted():
    s = make(verify_costs=STEEP_COSTS)
    add(s, 1, max_new=200)
    assert max(drafts_of(s)) > 0                       # accepted: drafts go out
    refused = drafts_of(s, accept=0, steps=60)
    tail = refused[-40:]                               # refused: they stop, but for
    assert sum(1 for n in tail if n) <= 4 and max(tail) <= 2   # a short try now and then


def test_a_free_curve_keeps_drafting_what_the_row_proposes():
    flat = make(verify_costs=tuple(1.0 for _ in range(64)))
    add(flat, 1, max_new=200)
    steep = make(verify_costs=STEEP_COSTS)
    add(steep, 1, max_new=200)
    assert sum(drafts_of(flat, accept=2)) > sum(drafts_of(steep, accept=2))
