"""scheduler_proc/scheduler.py + request.py: the pure Scheduler, driven by a stub worker."""

import random
from collections import defaultdict

import pytest

from protocol import SamplingParams, Step, StepResult, TokenizedRequest, WorkerError
from scheduler_proc.request import Request, Status
from scheduler_proc.scheduler import Scheduler, SchedulerLimits

EOS = 2
PLAIN = 7    # a token that stops nothing


def make_request(rid, n=4, max_new=8, stop=(EOS,), sampling=None):
    return TokenizedRequest(rid, [100 + i for i in range(n)], sampling or SamplingParams(),
                            max_new, list(stop))


def stub_worker(step: Step, token_for) -> StepResult:
    """Answer a Step as the worker would: one token per decoded or prefilled request."""
    rids = list(step.decode_rids) + [p.rid for p in step.prefills if p.needs_logits]
    tokens = [token_for(rid) for rid in rids]
    return StepResult(step.step_id, rids, tokens, [-0.25 * (i + 1) for i in range(len(rids))])


class Harness:
    """A Scheduler plus a model of the worker and of slot ownership, checked at every step."""

    def __init__(self, **limits):
        limits.setdefault("kv_capacity", 64)
        limits.setdefault("max_context", 1000)
        self.s = Scheduler(SchedulerLimits(**limits))
        self.worker_rids: set[int] = set()      # rids the worker holds state for
        self.owner: dict[int, int] = {}          # slot -> rid holding it
        self.entries: dict[int, list] = defaultdict(list)
        self.final: dict = {}                    # rid -> the entry with a finish_reason
        self.steps: list[Step] = []
        self.tokens = defaultdict(lambda: PLAIN)  # rid -> token the stub worker answers

    # -- driving --
    def add(self, *msgs):
        for msg in msgs:
            self.s.add_request(msg)
        self._after()

    def abort(self, rid):
        self.s.abort(rid)
        self._after()

    def schedule(self) -> Step | None:
        step = self.s.schedule()
        self.s.check_integrity()
        if step is not None:
            self._check_step(step)
            self.steps.append(step)
        self._after()
        return step

    def answer(self, step: Step, result: StepResult | None = None):
        self.s.process_result(result or stub_worker(step, lambda rid: self.tokens[rid]))
        self._after()

    def fail(self, step: Step, message="boom"):
        self.s.fail_step(WorkerError(step.step_id, message))
        self.worker_rids.clear()                 # the worker drops all state
        self._after()

    def run_step(self) -> Step | None:
        step = self.schedule()
        if step is not None:
            self.answer(step)
        return step

    def run_until_idle(self, limit=10_000) -> int:
        for n in range(limit):
            if self.run_step() is None:
                assert not self.s.has_work
                return n
        raise AssertionError("the scheduler never went idle")

    # -- checks --
    def _check_step(self, step: Step):
        assert step.step_id == len(self.steps) + 1
        assert len(step.decode_rids) == len(step.decode_slot_ids)
        for rid in step.releases:
            assert rid in self.worker_rids, f"release of {rid} the worker does not hold"
            assert rid not in self.s.running or rid in prefilled(step)   # a reused rid
            self.worker_rids.discard(rid)
        pending = {rid for rid in self.worker_rids if rid not in self.s.running}
        assert not pending, f"finished rids {pending} were not released"
        assert set(step.decode_rids) == self.worker_rids, "decode rids != worker's batch"
        assert len(set(step.decode_rids)) == len(step.decode_rids)
        for rid, slot in zip(step.decode_rids, step.decode_slot_ids):
            self._take(slot, rid)
        for p in step.prefills:
            assert p.rid not in self.worker_rids
            assert p.prefix_slot_ids == [] and p.needs_logits
            assert len(p.input_ids) == len(p.new_slot_ids) > 0
            for slot in p.new_slot_ids:
                self._take(slot, p.rid)
            self.worker_rids.add(p.rid)
        for req in self.s.running.values():
            assert sorted(req.slot_ids) == sorted(s for s, r in self.owner.items() if r == req.rid)
            assert len(req.slot_ids) <= req.kv_need

    def _take(self, slot, rid):
        assert slot != 0, "the padding slot was handed out"
        assert 1 <= slot <= self.s.limits.kv_capacity
        assert slot not in self.owner, f"slot {slot} of rid {self.owner.get(slot)} given to {rid}"
        self.owner[slot] = rid

    def _after(self):
        self.s.check_integrity()
        for entry in self.s.take_outputs():
            assert entry.rid not in self.final, f"entry for {entry.rid} after it finished"
            assert len(entry.token_ids) == len(entry.logprobs)
            self.entries[entry.rid].append(entry)
            if entry.finish_reason:
                self.final[entry.rid] = entry
        self.owner = {s: r for s, r in self.owner.items() if r in self.s.running}

    def output(self, rid) -> list[int]:
        return [t for e in self.entries[rid] for t in e.token_ids]


def prefilled(step) -> list[int]:
    return [p.rid for p in step.prefills]


# ---- Request -------------------------------------------------------------------------

def test_request_kv_need_and_finish_reason():
    req = Request.from_message(make_request(1, n=5, max_new=3, stop=(EOS, 9)), 3)
    assert req.kv_need == 5 + 3 - 1 and req.kv_outstanding == req.kv_need
    assert req.status is Status.WAITING and req.stop_token_ids == frozenset({EOS, 9})
    req.output_ids.append(PLAIN)
    assert req.finish_reason_after(PLAIN) is None
    req.output_ids.append(9)
    assert req.finish_reason_after(9) == "stop"
    req.output_ids.append(PLAIN)
    assert req.finish_reason_after(PLAIN) == "length"
    assert req.usage() == {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 0}


# ---- admission -----------------------------------------------------------------------

def test_idle_scheduler_schedules_nothing():
    h = Harness()
    assert h.schedule() is None and not h.s.has_work


def test_single_request_runs_to_length():
    h = Harness()
    h.add(make_request(1, n=4, max_new=3))
    first = h.run_step()
    assert prefilled(first) == [1] and first.decode_rids == []
    assert first.prefills[0].input_ids == [100, 101, 102, 103]
    assert h.run_until_idle() == 3          # two decodes, then one step releasing rid 1
    assert h.output(1) == [PLAIN] * 3
    final = h.final[1]
    assert final.finish_reason == "length" and final.error is None
    assert final.usage == {"prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 0}
    assert [len(e.token_ids) for e in h.entries[1]] == [1, 1, 1]
    assert [e.logprobs for e in h.entries[1]] == [[-0.25]] * 3
    assert h.steps[-1].releases == [1] and h.steps[-1].decode_rids == []
    assert h.s.allocator.num_free == 64


def test_fcfs_admission_order():
    h = Harness(max_running_requests=2)
    h.add(*[make_request(rid, max_new=2) for rid in (5, 3, 9, 1, 4)])
    order = []
    while (step := h.run_step()) is not None:
        order += prefilled(step)
    assert order == [5, 3, 9, 1, 4]
    assert set(h.final) == {5, 3, 9, 1, 4}


def test_fcfs_does_not_let_a_small_request_overtake_a_blocked_one():
    h = Harness(kv_capacity=20)
    h.add(make_request(1, n=10, max_new=5))      # kv_need 14
    h.add(make_request(2, n=10, max_new=5))      # does not fit beside rid 1
    h.add(make_request(3, n=1, max_new=1))       # would fit, but must wait its turn
    step = h.run_step()
    assert prefilled(step) == [1]
    while 1 not in h.final:
        assert h.run_step().prefills == []
    assert prefilled(h.run_step()) == [2, 3]


def test_max_running_requests_bound():
    h = Harness(max_running_requests=3)
    h.add(*[make_request(rid, max_new=4) for rid in range(1, 8)])
    while h.run_step() is not None:
        assert len(h.s.running) <= 3
        assert len(h.worker_rids) <= 3
    assert len(h.final) == 7
    assert all(e.finish_reason == "length" for e in h.final.values())


def test_max_running_requests_admits_as_soon_as_one_leaves():
    h = Harness(max_running_requests=2)
    h.tokens[1] = EOS
    h.add(*[make_request(rid, max_new=10) for rid in (1, 2, 3)])
    assert prefilled(h.run_step()) == [1, 2]     # rid 1 stops on its first token
    step = h.run_step()
    assert step.releases == [1] and prefilled(step) == [3] and step.decode_rids == [2]


@pytest.mark.parametrize("prompts,budget,first_step", [
    ([6, 6], 10, [1]),
    ([4, 6], 10, [1, 2]),            # exactly the budget
    ([4, 7], 10, [1]),
    ([20, 1], 10, [1]),              # one prefill even above the budget ...
    ([3, 3, 3, 3], 10, [1, 2, 3]),
    ([1, 30, 1], 10, [1]),           # ... but the budget stops later ones (FCFS)
])
def test_max_prefill_tokens_budget(prompts, budget, first_step):
    h = Harness(max_prefill_tokens=budget)
    h.add(*[make_request(rid, n=n, max_new=2) for rid, n in enumerate(prompts, 1)])
    assert prefilled(h.run_step()) == first_step
    while h.run_step() is not None:
        if h.steps[-1].prefills:
            lengths = [len(p.input_ids) for p in h.steps[-1].prefills]
            assert len(lengths) == 1 or sum(lengths) <= budget
    assert set(h.final) == set(range(1, len(prompts) + 1))


def test_kv_admission_reserves_prompt_plus_max_new_tokens():
    h = Harness(kv_capacity=30)
    h.add(make_request(1, n=10, max_new=11))     # kv_need 20
    h.add(make_request(2, n=5, max_new=6))       # kv_need 10: fits exactly
    h.add(make_request(3, n=1, max_new=1))       # kv_need 1: no room left
    assert prefilled(h.run_step()) == [1, 2]
    # only 15 slots are used now, but 15 more are promised to rids 1 and 2
    assert h.s.allocator.num_free == 15
    while 2 not in h.final:
        assert h.run_step().prefills == []
    assert prefilled(h.run_step()) == [3]


def test_kv_admission_lets_the_running_requests_finish_without_running_out():
    h = Harness(kv_capacity=40, max_prefill_tokens=10_000)
    h.add(*[make_request(rid, n=5, max_new=20) for rid in range(1, 10)])   # kv_need 24 each
    h.run_until_idle()
    assert all(h.final[rid].finish_reason == "length" for rid in range(1, 10))
    assert all(len(h.output(rid)) == 20 for rid in range(1, 10))
    assert h.s.allocator.num_free == 40


def test_a_request_using_the_whole_kv_cache():
    h = Harness(kv_capacity=12)
    h.add(make_request(1, n=4, max_new=9))       # kv_need 12 == capacity
    h.run_until_idle()
    assert len(h.output(1)) == 9 and h.final[1].finish_reason == "length"
    assert max(len(s.decode_slot_ids) for s in h.steps) == 1
    assert h.s.allocator.num_free == 12


# ---- continuous batching -------------------------------------------------------------

def test_requests_join_and_leave_between_steps():
    h = Harness()
    h.add(make_request(1, max_new=5))
    h.run_step()
    h.run_step()
    h.add(make_request(2, max_new=2))
    step = h.run_step()
    assert step.decode_rids == [1] and prefilled(step) == [2]
    step = h.run_step()
    assert step.decode_rids == [1, 2]            # rid 2 finishes here (length 2)
    assert h.final[2].finish_reason == "length"
    h.add(make_request(3, max_new=2))
    step = h.run_step()                          # rid 1 finishes here (length 5)
    assert step.decode_rids == [1] and step.releases == [2] and prefilled(step) == [3]
    assert h.final[1].finish_reason == "length"
    step = h.run_step()
    assert step.decode_rids == [3] and step.releases == [1]
    step = h.run_step()
    assert step.releases == [3] and not step.decode_rids and not step.prefills
    assert h.run_step() is None
    assert [len(h.output(r)) for r in (1, 2, 3)] == [5, 2, 2]


# ---- finishing -----------------------------------------------------------------------

def test_stop_token():
    h = Harness()
    h.add(make_request(1, max_new=10, stop=(EOS, 50)))
    h.run_step()
    h.run_step()
    h.tokens[1] = 50
    h.run_step()
    assert h.output(1) == [PLAIN, PLAIN, 50]
    assert h.final[1].finish_reason == "stop" and h.final[1].token_ids == [50]
    assert h.final[1].usage["completion_tokens"] == 3
    assert h.run_step().releases == [1]


def test_stop_token_on_the_first_token():
    h = Harness()
    h.tokens[1] = EOS
    h.add(make_request(1, n=3, max_new=10))
    h.run_step()
    assert h.final[1].finish_reason == "stop" and h.output(1) == [EOS]
    assert h.s.allocator.num_free == 64


def test_stop_token_wins_over_length():
    h = Harness()
    h.tokens[1] = EOS
    h.add(make_request(1, max_new=1))
    h.run_step()
    assert h.final[1].finish_reason == "stop"


def test_stop_token_ids_are_per_request():
    h = Harness()
    h.tokens.update({1: 9, 2: 9})
    h.add(make_request(1, max_new=3, stop=(9,)), make_request(2, max_new=3, stop=(EOS,)))
    h.run_until_idle()
    assert h.final[1].finish_reason == "stop" and len(h.output(1)) == 1
    assert h.final[2].finish_reason == "length" and len(h.output(2)) == 3


@pytest.mark.parametrize("kv_capacity,max_context,n,asked,expected", [
    (1000, 20, 5, 100, 15),      # capped by the context: prompt + output <= max_context
    (1000, 20, 19, 100, 1),
    (10, 1000, 4, 100, 7),       # capped by the KV cache: kv_need <= kv_capacity
    (10, 1000, 10, 100, 1),      # prompt == kv_capacity still gets one token
    (10, 12, 4, 100, 7),
    (10, 9, 4, 100, 5),
    (1000, 1000, 4, 6, 6),       # not capped
])
def test_max_new_tokens_is_capped(kv_capacity, max_context, n, asked, expected):
    h = Harness(kv_capacity=kv_capacity, max_context=max_context)
    h.add(make_request(1, n=n, max_new=asked))
    h.run_until_idle()
    assert len(h.output(1)) == expected and h.final[1].finish_reason == "length"
    assert h.s.allocator.num_free == kv_capacity


# ---- aborts --------------------------------------------------------------------------

def test_abort_waiting_request():
    h = Harness(max_running_requests=1)
    h.add(make_request(1), make_request(2, n=6))
    h.run_step()
    h.abort(2)
    entry = h.final[2]
    assert entry.finish_reason == "abort" and entry.token_ids == []
    assert entry.usage == {"prompt_tokens": 6, "completion_tokens": 0, "cached_tokens": 0}
    assert all(r.rid != 2 for r in h.s.waiting)
    h.run_until_idle()
    assert all(2 not in prefilled(s) for s in h.steps)
    assert h.final[1].finish_reason == "length"


def test_abort_running_request():
    h = Harness()
    h.add(make_request(1, n=5, max_new=10), make_request(2, max_new=10))
    h.run_step()
    h.run_step()
    used = h.s.allocator.num_used
    h.abort(1)
    entry = h.final[1]
    assert entry.finish_reason == "abort" and entry.token_ids == []
    assert entry.usage == {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 0}
    assert h.s.allocator.num_used == used - 6     # prompt 5 + one decode slot
    step = h.run_step()
    assert step.releases == [1] and step.decode_rids == [2]
    assert h.run_step().releases == []


def test_abort_while_the_step_is_in_flight_ignores_its_result():
    h = Harness()
    h.add(make_request(1, max_new=10), make_request(2, max_new=10))
    h.run_step()
    step = h.schedule()
    h.abort(1)
    free_after_abort = h.s.allocator.num_free
    h.answer(step)                               # still carries a token for rid 1
    assert len(h.entries[1]) == 2 and h.entries[1][-1].finish_reason == "abort"
    assert h.s.allocator.num_free == free_after_abort
    assert h.output(2) == [PLAIN, PLAIN]
    assert h.schedule().releases == [1]


def test_abort_of_a_request_whose_prefill_is_in_flight():
    h = Harness()
    h.add(make_request(1, n=8, max_new=10))
    step = h.schedule()
    h.abort(1)
    assert h.s.allocator.num_free == 64
    h.answer(step)
    assert h.output(1) == [] and h.final[1].finish_reason == "abort"
    assert h.run_step().releases == [1]
    assert h.run_step() is None


def test_abort_unknown_or_finished_rid_is_a_no_op():
    h = Harness()
    h.add(make_request(1, max_new=1), make_request(2, max_new=5))
    h.run_step()
    assert 1 in h.final
    stats = h.s.stats()
    h.abort(1)                                   # finished
    h.abort(999)                                 # never seen
    assert h.s.stats() == stats and h.s.take_outputs() == []
    assert len(h.entries[1]) == 1
    h.run_until_idle()
    assert h.final[2].finish_reason == "length"


def test_result_for_unknown_rid_is_ignored():
    h = Harness()
    h.add(make_request(1, max_new=3))
    step = h.schedule()
    h.answer(step, StepResult(step.step_id, [1, 42], [PLAIN, PLAIN], [-1.0, -1.0]))
    assert 42 not in h.entries and h.output(1) == [PLAIN]


def test_top_logprobs_are_passed_through():
    h = Harness()
    h.add(make_request(1, max_new=3), make_request(2, max_new=3))
    step = h.schedule()
    top = [[PLAIN, 8], [-0.1, -2.0]]
    h.answer(step, StepResult(step.step_id, [1, 2], [PLAIN, PLAIN], [-0.1, -0.2], [top, None]))
    assert h.entries[1][0].top_logprobs == [top]
    assert h.entries[2][0].top_logprobs is None
    assert h.entries[2][0].logprobs == [-0.2]


# ---- worker failure ------------------------------------------------------------------

def test_fail_step_finishes_all_running_requests_with_the_error():
    h = Harness(max_running_requests=2)
    h.add(*[make_request(rid, max_new=10) for rid in (1, 2, 3)])
    h.run_step()
    h.abort(2)                                   # its release is pending
    step = h.schedule()
    h.fail(step, "RuntimeError: the GPU fell off")
    assert h.final[1].finish_reason == "error"
    assert h.final[1].error == "RuntimeError: the GPU fell off"
    assert h.final[3].finish_reason == "error"   # admitted in the failed step
    assert h.final[2].finish_reason == "abort"
    assert not h.s.running and h.s.allocator.num_free == 64
    assert h.schedule() is None                  # the worker dropped everything already
    h.add(make_request(4, max_new=2))
    assert prefilled(h.run_step()) == [4]
    h.run_until_idle()
    assert h.final[4].finish_reason == "length"


def test_fail_step_keeps_waiting_requests():
    h = Harness(max_running_requests=1)
    h.add(make_request(1, max_new=10), make_request(2, max_new=2))
    step = h.schedule()
    h.fail(step)
    assert h.final[1].finish_reason == "error" and 2 not in h.final
    step = h.run_step()
    assert prefilled(step) == [2] and step.releases == []
    h.run_until_idle()
    assert h.final[2].finish_reason == "length"


# ---- rejections ----------------------------------------------------------------------

@pytest.mark.parametrize("n,why", [
    (0, "empty"),
    (20, "context"),        # n == max_context
    (25, "context"),
    (17, "KV cache"),       # n > kv_capacity
])
def test_rejections(n, why):
    h = Harness(kv_capacity=16, max_context=20)
    h.add(make_request(1, n=n))
    entry = h.final[1]
    assert entry.finish_reason == "error" and why in entry.error
    assert entry.token_ids == [] and entry.logprobs == []
    assert not h.s.has_work and h.schedule() is None


def test_largest_accepted_prompt():
    h = Harness(kv_capacity=16, max_context=17)
    h.add(make_request(1, n=16, max_new=5))
    h.run_until_idle()
    assert h.final[1].finish_reason == "length" and len(h.output(1)) == 1


def test_duplicate_rid_is_rejected_without_touching_the_original():
    h = Harness(max_running_requests=1)
    h.add(make_request(1, max_new=3), make_request(2, max_new=3))
    h.run_step()
    for rid in (1, 2):                           # one running, one waiting
        h.s.add_request(make_request(rid, n=2))
        (entry,) = h.s.take_outputs()
        assert entry.rid == rid and entry.finish_reason == "error"
        assert "already in use" in entry.error
        h.s.check_integrity()
    assert len(h.s.waiting) == 1 and list(h.s.running) == [1]
    h.run_until_idle()
    assert len(h.output(1)) == 3 and len(h.output(2)) == 3


def test_a_finished_rid_may_be_reused():
    h = Harness()
    h.add(make_request(1, max_new=1))
    h.run_step()
    h.final.clear()
    h.entries.clear()
    h.add(make_request(1, max_new=2))
    step = h.run_step()
    assert step.releases == [1] and prefilled(step) == [1]
    h.run_until_idle()
    assert len(h.output(1)) == 2


# ---- stats ---------------------------------------------------------------------------

def test_stats_and_has_work():
    h = Harness(kv_capacity=32, max_running_requests=1)
    h.add(make_request(1, n=4, max_new=3), make_request(2, n=4, max_new=3))
    assert h.s.stats() == {"waiting": 2, "running": 0, "free_slots": 32, "used_slots": 0}
    h.run_step()
    assert h.s.stats() == {"waiting": 1, "running": 1, "free_slots": 28, "used_slots": 4}
    h.run_step()
    assert h.s.stats()["used_slots"] == 5
    h.run_until_idle()
    assert h.s.stats() == {"waiting": 0, "running": 0, "free_slots": 32, "used_slots": 0}
    assert not h.s.has_work


# ---- randomized soak -----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_randomized_soak(seed):
    rng = random.Random(seed)
    kv_capacity = [16, 40, 200, 200, 100, 300][seed]
    max_context = [12, 30, 500, 40, 500, 64][seed]
    h = Harness(kv_capacity=kv_capacity, max_context=max_context,
                max_running_requests=[1, 3, 16, 8, 64, 32][seed],
                max_prefill_tokens=[1, 8, 64, 16, 4096, 10][seed])
    asked: dict[int, TokenizedRequest] = {}
    next_rid = 1
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            biggest = min(max_context, kv_capacity) + 2   # some are rejected
            n = rng.randint(1, 6) if rng.random() < 0.85 else rng.randint(0, biggest)
            msg = make_request(next_rid, n=n, max_new=rng.randint(1, 30), stop=(EOS,))
            asked[next_rid] = msg
            h.add(msg)
            next_rid += 1
        for rid in range(1, next_rid):          # choose each running request's next token
            h.tokens[rid] = EOS if rng.random() < 0.04 else rng.randrange(3, 500)
        step = h.schedule()
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            h.abort(rng.randrange(1, next_rid + 3))
        if step is not None:
            if rng.random() < 0.02:
                h.fail(step, f"failure in step {step.step_id}")
            else:
                h.answer(step)
    h.run_until_idle()
    assert h.s.allocator.num_free == kv_capacity and not h.s.waiting and not h.s.running
    assert set(h.final) == set(asked)
    for rid, msg in asked.items():
        final, out = h.final[rid], h.output(rid)
        assert final.finish_reason in ("stop", "length", "abort", "error")
        if final.finish_reason == "error" and final.usage is None:
            assert out == []                     # rejected up front
            continue
        n = len(msg.input_ids)
        assert final.usage == {"prompt_tokens": n, "completion_tokens": len(out),
                               "cached_tokens": 0}
        cap = min(msg.max_new_tokens, min(max_context, kv_capacity + 1) - n)
        assert len(out) <= cap
        assert EOS not in out[:-1]
        if final.finish_reason == "stop":
            assert out[-1] == EOS
        if final.finish_reason == "length":
            assert len(out) == cap and (not out or out[-1] != EOS)
