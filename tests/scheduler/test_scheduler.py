"""scheduler_proc/scheduler.py + kv_book.py + request.py + waiting.py: the pure
Scheduler, driven by the stub worker in scheduler_harness.py, which checks every Step
against the scheduler's books and against a modelled KV pool."""

import dataclasses
import random
import re
from collections import defaultdict

import pytest

from mlxd.protocol import (
    REPETITION_CONTEXT, SamplingParams, StepResult, TokenizedRequest, Usage, WorkerError,
)
from mlxd.scheduler_proc.kv_book import KVBook
from mlxd.scheduler_proc.request import Request, Status
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.scheduler_proc.waiting import LPM_OVERTAKE_LIMIT, LPM_QUEUE_LIMIT, SHARED_PREFIX_WAIT
from scheduler_harness import (
    EOS, PLAIN, Harness, by_position, make_request, prefilled, prompt_of, run_to_finish,
)

HEADROOM = SchedulerLimits(1, 1).decode_headroom   # 16


# ---- Request -------------------------------------------------------------------------

def test_request_progress_and_finish_reason():
    req = Request.from_message(make_request(1, n=5, max_new=3, stop=(EOS, 9)), 3)
    assert req.num_tokens == 5 and req.behind == 5 and req.all_ids == prompt_of(1, 5)
    assert req.status is Status.WAITING and req.stop_token_ids == frozenset({EOS, 9})
    assert req.cached_tokens is None and req.retractions == 0
    assert not req.prefilling and not req.running
    KVBook(8).extend(req, 5)                      # KV for the whole prompt
    assert req.behind == 0
    req.output_ids.append(PLAIN)
    assert req.num_tokens == 6 and req.behind == 1   # the token a decode computes
    assert req.finish_reason_after(PLAIN) is None
    assert req.all_ids == prompt_of(1, 5) + [PLAIN]
    req.output_ids.append(9)
    assert req.finish_reason_after(9) == "stop"
    req.output_ids.append(PLAIN)
    assert req.finish_reason_after(PLAIN) == "length"
    assert req.usage() == Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=0)
    req.cached_tokens = 4
    assert req.usage().cached_tokens == 4


# ---- admission -----------------------------------------------------------------------

def test_idle_scheduler_schedules_nothing():
    h = Harness()
    assert h.schedule() is None and not h.s.has_work


def test_single_request_runs_to_length():
    h = Harness()
    h.add(make_request(1, n=4, max_new=3))
    first = h.run_step()
    assert prefilled(first) == [1] and first.decode_rids == []
    [p] = first.prefills
    assert p.input_ids == prompt_of(1, 4) and p.prefix_slot_ids == []
    assert p.needs_logits and p.num_generated == 0
    assert h.run_until_idle() == 3          # two decodes, then one step releasing rid 1
    assert h.output(1) == [PLAIN] * 3
    final = h.final[1]
    assert final.finish_reason == "length" and final.error is None
    assert final.usage == Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=0)
    assert [len(e.token_ids) for e in h.entries[1]] == [1, 1, 1]
    assert [e.logprobs for e in h.entries[1]] == [[-0.25]] * 3
    assert h.steps[-1].releases == [1] and h.steps[-1].decode_rids == []
    # the prompt and every output but the last stay cached, unlocked
    h.assert_idle()
    assert h.s.kv.tree.evictable_size == 4 + 2 and h.s.kv.allocator.num_free == 64 - 6


def test_the_first_and_the_last_entry_carry_usage():
    h = Harness()
    h.add(make_request(1, n=5, max_new=4))
    h.run_until_idle()
    usages = [e.usage for e in h.entries[1]]
    assert usages == [Usage(prompt_tokens=5, completion_tokens=1, cached_tokens=0),
                      None, None,
                      Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=0)]


def test_fcfs_admission_order():
    h = Harness(max_running_requests=2)
    h.add(*[make_request(rid, max_new=2) for rid in (5, 3, 9, 1, 4)])
    order = []
    while (step := h.run_step()) is not None:
        order += prefilled(step)
    assert order == [5, 3, 9, 1, 4]
    assert set(h.final) == {5, 3, 9, 1, 4}


def test_fcfs_does_not_let_a_small_request_overtake_a_blocked_one():
    h = Harness(kv_capacity=64)
    h.add(make_request(1, n=30, max_new=5))     # needs 30 + 16 headroom
    h.add(make_request(2, n=30, max_new=5))     # needs 30 + 2 x 16: only 34 are left
    h.add(make_request(3, n=1, max_new=1))      # needs 1 + 2 x 16: would fit, must wait
    step = h.run_step()
    assert prefilled(step) == [1]
    while 1 not in h.final:
        assert h.run_step().prefills == []
    step = h.run_step()
    assert prefilled(step) == [2, 3] and step.releases == [1]
    h.run_until_idle()
    h.assert_idle()


def test_max_running_requests_bound():
    h = Harness(max_running_requests=3)
    h.add(*[make_request(rid, max_new=4) for rid in range(1, 8)])
    while h.run_step() is not None:
        assert len(h.s.running) <= 3
        assert len(h.batch) <= 3
    assert len(h.final) == 7
    assert all(e.finish_reason == "length" for e in h.final.values())


def test_max_running_requests_admits_as_soon_as_one_leaves():
    h = Harness(max_running_requests=2)
    h.tokens[1] = EOS
    h.add(*[make_request(rid, max_new=10) for rid in (1, 2, 3)])
    assert prefilled(h.run_step()) == [1, 2]     # rid 1 stops on its first token
    step = h.run_step()
    assert step.releases == [1] and prefilled(step) == [3] and step.decode_rids == [2]


@pytest.mark.parametrize("prompts,budget,first_step,lengths", [
    ([6, 6], 10, [1, 2], [6, 4]),            # the budget's rest starts a chunked prefill
    ([4, 6], 10, [1, 2], [4, 6]),            # exactly the budget
    ([4, 7], 10, [1, 2], [4, 6]),
    ([20, 1], 10, [1], [10]),                # a long prompt is cut to the budget
    ([3, 3, 3, 3], 10, [1, 2, 3, 4], [3, 3, 3, 1]),
    ([1, 30, 1], 10, [1, 2], [1, 9]),        # the budget stops later ones (FCFS)
    ([6, 6, 1], 10, [1, 2], [6, 4]),         # ... even a request that would fit
])
def test_max_prefill_tokens_budget(prompts, budget, first_step, lengths):
    h = Harness(max_prefill_tokens=budget, kv_capacity=256)
    h.add(*[make_request(rid, n=n, max_new=2) for rid, n in enumerate(prompts, 1)])
    step = h.run_step()
    assert prefilled(step) == first_step
    assert [len(p.input_ids) for p in step.prefills] == lengths
    while h.run_step() is not None:
        assert sum(len(p.input_ids) for p in h.steps[-1].prefills) <= budget
    assert all(h.final[rid].finish_reason == "length" for rid in range(1, len(prompts) + 1))
    assert all(len(h.output(rid)) == 2 for rid in range(1, len(prompts) + 1))


def test_admission_needs_the_chunk_plus_decode_headroom_per_row():
    h = Harness(kv_capacity=64)
    h.add(make_request(1, n=16, max_new=3))      # 16 + 16 x 1 <= 64
    h.add(make_request(2, n=16, max_new=5))      # 16 + 16 x 2 <= 64 - 16: fits exactly
    h.add(make_request(3, n=1, max_new=1))       # 1 + 16 x 3 > 32
    assert prefilled(h.run_step()) == [1, 2]
    assert h.s.kv.allocator.num_free == 32       # nothing is reserved beyond the prompts
    assert prefilled(h.run_step()) == []         # 1 + 16 x 3 > 30, then 28 free
    assert prefilled(h.run_step()) == []
    assert h.final[1].finish_reason == "length"
    # rid 1's 18 tokens are cached but evictable: 1 + 16 x 2 now fits
    step = h.run_step()
    assert prefilled(step) == [3] and step.releases == [1] and step.decode_rids == [2]
    h.run_until_idle()
    h.assert_idle()


def test_a_request_using_the_whole_kv_cache():
    h = Harness(kv_capacity=24)
    h.add(make_request(1, n=4, max_new=21))      # 4 + 20 decodes == capacity
    h.run_until_idle()
    assert len(h.output(1)) == 21 and h.final[1].finish_reason == "length"
    assert max(len(s.decodes) for s in h.steps) == 1
    assert h.s.kv.allocator.num_free == 0 and h.s.kv.tree.evictable_size == 24
    h.assert_idle()


@pytest.mark.parametrize("n,max_new", [(15, 2), (10, 7), (1, 16)])
def test_a_request_that_fits_the_pool_alone_is_served(n, max_new):
    """The prompt is accepted (n < kv_capacity) and prompt + outputs fit in the pool, but
    prompt + decode_headroom does not: with nothing else running it must still run."""
    h = Harness(kv_capacity=16, max_context=n + max_new)
    h.add(make_request(1, n=n, max_new=max_new))
    assert h.run_step() is not None, "an accepted request is never scheduled"
    h.run_until_idle(limit=100)
    assert h.final[1].finish_reason == "length" and len(h.output(1)) == max_new
    h.assert_idle()


def test_decode_cache_width_is_budgeted():
    h = Harness(kv_capacity=4096, decode_cache_tokens=512, max_running_requests=8)
    h.add(*[make_request(rid, n=4, max_new=3) for rid in (1, 2, 3)])
    assert prefilled(h.run_step()) == [1, 2]     # 3 rows x 256 > 512
    h.run_until_idle()
    assert all(len(h.output(rid)) == 3 for rid in (1, 2, 3))
    # a long row widens every row: 2 x round_up(300) > 512
    h.add(make_request(4, n=300, max_new=3), make_request(5, n=4, max_new=3))
    assert prefilled(h.run_step()) == [4]
    while 4 not in h.final:
        assert h.run_step().decode_rids == [4]
    h.run_until_idle()
    assert len(h.output(5)) == 3


def test_decode_cache_width_retracts_a_row_that_grows_past_a_step():
    h = Harness(kv_capacity=4096, decode_cache_tokens=512, max_running_requests=8)
    h.token_fn = by_position
    h.add(make_request(1, n=250, max_new=20), make_request(2, n=4, max_new=20))
    assert prefilled(h.run_step()) == [1, 2]     # widths 2 x 256
    h.run_until_idle()
    # step 7 would need width round_up(256 + 2) = 512 for rid 1: 2 x 512 > 512; it
    # holds more KV than rid 2
    assert h.retracted == [(7, 1)] and h.s.num_retractions == 1
    assert h.output(1) == [by_position(1, 250 + i) for i in range(20)]
    assert h.output(2) == [by_position(2, 4 + i) for i in range(20)]
    [(rid, generated, tokens)] = h.resumes
    assert rid == 1 and generated == 6 and tokens == prompt_of(1, 250) + h.output(1)[:6]
    h.assert_idle()


def test_a_lone_request_wider_than_the_decode_caches_does_not_hang():
    """With a decode budget set below round_up(261) = 512 the request cannot decode:
    it must finish (with an error) rather than wait forever."""
    h = Harness(kv_capacity=300, max_running_requests=1, decode_cache_tokens=300)
    assert h.s.decode_cache_tokens == 300
    h.add(make_request(1, n=260, max_new=3))
    h.run_until_idle(limit=100)
    assert 1 in h.final, "the request neither ran nor finished"


def test_a_lone_request_growing_wider_than_the_decode_caches_gets_a_true_error():
    """At 256 tokens its padded decode cache (round_up(256 + 2) = 512) outgrows a decode
    budget set to 300: it must stop, but the error must not blame a pool that holds it."""
    h = Harness(kv_capacity=300, max_running_requests=1, decode_cache_tokens=300)
    h.add(make_request(1, n=200, max_new=100))
    h.run_until_idle()
    final = h.final[1]
    assert final.finish_reason == "error" and len(h.output(1)) == 56
    claim = re.search(r"needs (\d+) KV slots; the pool holds (\d+)", final.error)
    assert not claim or int(claim[1]) > int(claim[2]), f"untrue error: {final.error!r}"


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
    h.assert_idle()


def test_several_short_prompts_in_one_step():
    h = Harness(kv_capacity=512)
    shared = prompt_of(99, SHARED_PREFIX_WAIT - 1)   # too short a shared part to wait for
    h.add(*[make_request(rid, n=3, max_new=3) for rid in (1, 2, 3)])
    h.add(*[make_request(rid, prompt=shared + [rid]) for rid in (4, 5)])
    step = h.run_step()
    assert prefilled(step) == [1, 2, 3, 4, 5]
    assert all(p.needs_logits and p.prefix_slot_ids == [] for p in step.prefills)
    assert h.run_step().decode_rids == [1, 2, 3, 4, 5]
    # both computed the shared part; the tree keeps one copy, the other is freed
    assert h.s.kv.tree.total_size == 3 * 3 + len(shared) + 2
    h.run_until_idle()
    h.assert_idle()


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
    assert h.final[1].usage.completion_tokens == 3
    assert h.run_step().releases == [1]


def test_stop_token_on_the_first_token():
    h = Harness()
    h.tokens[1] = EOS
    h.add(make_request(1, n=3, max_new=10))
    h.run_step()
    assert h.final[1].finish_reason == "stop" and h.output(1) == [EOS]
    assert h.final[1].usage == Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0)
    assert len(h.entries[1]) == 1
    h.run_until_idle()
    h.assert_idle()


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


@pytest.mark.parametrize("max_context,n,asked,expected", [
    (20, 5, 100, 15),            # prompt + output <= max_context
    (20, 19, 100, 1),
    (12, 4, 100, 8),
    (1000, 4, 6, 6),             # not capped
])
def test_max_new_tokens_is_capped_by_the_context(max_context, n, asked, expected):
    h = Harness(kv_capacity=1000, max_context=max_context)
    h.add(make_request(1, n=n, max_new=asked))
    h.run_until_idle()
    assert len(h.output(1)) == expected and h.final[1].finish_reason == "length"
    h.assert_idle()


@pytest.mark.parametrize("n,max_new,accepted", [
    (4, 37, True), (4, 38, False), (39, 2, True), (39, 3, False), (4, 10**6, False),
])
def test_a_request_bigger_than_the_pool_is_refused_up_front(n, max_new, accepted):
    """Prompt + max_tokens (the last token needs no KV) must fit the 40-slot pool."""
    h = Harness(kv_capacity=40, max_context=4096)
    h.add(make_request(1, n=n, max_new=max_new))
    if accepted:
        assert 1 not in h.final
        h.run_until_idle(limit=200)
        assert h.final[1].finish_reason == "length" and len(h.output(1)) == max_new
    else:
        final = h.final[1]
        assert final.finish_reason == "error" and h.output(1) == []
        assert "max_tokens" in final.error and "40" in final.error
        assert h.run_step() is None
    h.assert_idle()


def test_max_tokens_beyond_the_context_is_clamped_before_the_pool_check():
    """max_tokens larger than the context leaves is clamped, not refused: 4 + 36 fits."""
    h = Harness(kv_capacity=40, max_context=40)
    h.add(make_request(1, n=4, max_new=10**6))
    h.run_until_idle(limit=200)
    assert h.final[1].finish_reason == "length" and len(h.output(1)) == 36
    h.assert_idle()


def test_a_request_that_outgrows_the_pool_alone_finishes_with_an_error():
    h = Harness(kv_capacity=40)
    h.add_past_the_length_check(make_request(1, n=4, max_new=100))
    h.run_until_idle()
    final = h.final[1]
    assert final.finish_reason == "error" and final.token_ids == []
    assert "KV" in final.error and "40" in final.error
    assert len(h.output(1)) == 37                 # 4 + 36 decodes fill the pool
    assert final.usage == Usage(prompt_tokens=4, completion_tokens=37, cached_tokens=0)
    assert h.s.kv.tree.evictable_size == 40       # what it computed stays cached
    h.assert_idle()


def test_a_request_too_big_to_run_alone_errors_and_the_others_go_on():
    h = Harness(kv_capacity=64)
    h.token_fn = by_position
    h.add_past_the_length_check(make_request(1, n=4, max_new=200))
    h.add(make_request(2, n=4, max_new=30))
    h.run_until_idle()
    assert h.final[1].finish_reason == "error" and "KV" in h.final[1].error
    assert h.final[2].finish_reason == "length"
    assert h.output(2) == [by_position(2, 4 + i) for i in range(30)]
    assert h.output(1) == [by_position(1, 4 + i) for i in range(len(h.output(1)))]
    assert h.s.num_retractions >= 1
    h.assert_idle()


# ---- aborts --------------------------------------------------------------------------

def test_abort_waiting_request():
    h = Harness(max_running_requests=1)
    h.add(make_request(1), make_request(2, n=6))
    h.run_step()
    h.abort(2)
    entry = h.final[2]
    assert entry.finish_reason == "abort" and entry.token_ids == []
    assert entry.usage == Usage(prompt_tokens=6, completion_tokens=0, cached_tokens=0)
    assert all(r.rid != 2 for r in h.s.waiting)
    h.run_until_idle()
    assert all(2 not in prefilled(s) for s in h.steps)
    assert h.final[1].finish_reason == "length"


def test_abort_running_request():
    h = Harness()
    h.add(make_request(1, n=5, max_new=10), make_request(2, max_new=10))
    h.run_step()
    h.run_step()
    free = h.s.kv.allocator.num_free
    h.abort(1)
    entry = h.final[1]
    assert entry.finish_reason == "abort" and entry.token_ids == []
    assert entry.usage == Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=0)
    # prompt 5 + one decode slot move to the tree, unlocked; rid 2's prompt stays locked
    tree = h.s.kv.tree
    assert h.s.kv.allocator.num_free == free
    assert (tree.evictable_size, tree.protected_size) == (6, 4)
    step = h.run_step()
    assert step.releases == [1] and step.decode_rids == [2]
    assert h.run_step().releases == []


def test_abort_while_the_step_is_in_flight_ignores_its_result():
    h = Harness()
    h.add(make_request(1, max_new=10), make_request(2, max_new=10))
    h.run_step()
    step = h.schedule()
    h.abort(1)
    free_after_abort = h.s.kv.allocator.num_free
    h.answer(step)                               # still carries a token for rid 1
    assert len(h.entries[1]) == 2 and h.entries[1][-1].finish_reason == "abort"
    assert h.s.kv.allocator.num_free == free_after_abort
    assert h.output(2) == [PLAIN, PLAIN]
    assert h.schedule().releases == [1]


def test_abort_of_a_request_whose_prefill_is_in_flight():
    h = Harness()
    h.add(make_request(1, n=8, max_new=10))
    step = h.schedule()
    h.abort(1)
    assert h.s.kv.tree.evictable_size == 8       # cached: the step in flight computes it
    h.answer(step)
    assert h.output(1) == [] and h.final[1].finish_reason == "abort"
    assert h.run_step().releases == [1]
    assert h.run_step() is None
    h.assert_idle()
    h.add(make_request(2, prompt=prompt_of(1, 8) + [5]))
    assert h.run_step().prefills[0].prefix_slot_ids == step.prefills[0].new_slot_ids


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

def _undisturbed(requests, **limits) -> dict[int, list[int]]:
    h = Harness(**limits)
    h.token_fn = by_position
    h.add(*requests)
    h.run_until_idle()
    return {r.rid: h.output(r.rid) for r in requests}


def test_fail_step_resumes_running_requests_where_they_stopped():
    """The worker dropped every request's state: each running request prefills its
    prompt and output so far again and goes on with the same tokens."""
    requests = [make_request(rid, max_new=10) for rid in (1, 2, 3)]
    h = Harness(max_running_requests=2)
    h.token_fn = by_position
    h.add(*requests)
    h.run_step()
    h.run_step()
    h.abort(2)                                   # its release is pending
    step = h.schedule()
    h.fail(step, "RuntimeError: the GPU fell off")
    assert 1 not in h.final and 3 not in h.final and h.final[2].finish_reason == "abort"
    assert not h.s.running and h.s.kv.allocator.num_free == 64   # the tree is emptied too
    assert h.s.kv.tree.total_size == 0 and h.s.stats()["resumes"] == 2
    so_far = h.output(1)
    p, q = h.run_step().prefills                 # 3 was admitted in the failed step
    assert p.rid == 1 and p.input_ids == prompt_of(1, 4) + so_far
    assert q.rid == 3 and q.input_ids == prompt_of(3, 4) and q.num_generated == 0
    assert p.prefix_slot_ids == [] and p.num_generated == 2
    h.run_until_idle()
    want = _undisturbed([requests[0], requests[2]], max_running_requests=2)
    assert h.output(1) == want[1] and h.output(3) == want[3]
    assert h.final[1].usage == Usage(prompt_tokens=4, completion_tokens=10, cached_tokens=0,
                                     resumes=1)
    assert h.final[3].usage.resumes == 1         # its prefill ran at the death: it counts
    h.assert_idle()


def test_a_resumed_request_reports_its_resume_at_once():
    """An entry with no token, only the usage: its front end counts the resume even
    if this scheduler dies before the request's next token."""
    h = Harness()
    h.add(make_request(1, max_new=10))
    h.run_step()
    h.fail(h.schedule())
    entry = h.entries[1][-1]
    assert entry.token_ids == [] and not entry.finish_reason and entry.usage.resumes == 1
    h.run_step()
    assert h.entries[1][-1].token_ids and h.entries[1][-1].usage is None


def test_a_request_resumed_elsewhere_goes_on_after_its_tokens_and_reports_its_count():
    """A front end resumed it here with the tokens it had streamed: it prefills
    prompt + those, counts them against max_tokens, and its first tokens here carry
    its usage (resumes, and the prompt's cached tokens only)."""
    s = Scheduler(SchedulerLimits(kv_capacity=64, max_context=1000))
    s.add_request(dataclasses.replace(make_request(1, max_new=4), output_ids=[50, 51],
                                      resumes=1))
    step = s.schedule()
    [p] = step.prefills
    assert p.input_ids == prompt_of(1, 4) + [50, 51] and p.num_generated == 2
    s.process_result(StepResult(step.step_id, [1], [60], [-0.5]))
    [entry] = s.take_outputs()
    assert entry.token_ids == [60] and entry.usage.resumes == 1
    assert entry.usage.completion_tokens == 3 and entry.usage.cached_tokens == 0
    step = s.schedule()
    s.process_result(StepResult(step.step_id, [1], [61], [-0.5]))
    [entry] = s.take_outputs()
    assert entry.finish_reason == "length" and entry.usage.completion_tokens == 4


def test_a_resumed_request_with_nothing_left_to_generate_is_refused():
    s = Scheduler(SchedulerLimits(kv_capacity=64, max_context=1000))
    s.add_request(dataclasses.replace(make_request(1, max_new=2), output_ids=[50, 51],
                                      resumes=1))
    [entry] = s.take_outputs()
    assert entry.finish_reason == "error" and "no tokens left" in entry.error


def test_a_request_running_at_a_second_death_ends_with_an_error_naming_the_cause():
    h = Harness()
    h.add(make_request(1, max_new=10), make_request(2, max_new=10))
    h.run_step()
    h.worker_dies("the worker process died")
    h.run_step()
    h.abort(2)
    h.worker_dies("the worker process died")
    entry = h.final[1]
    assert entry.finish_reason == "error" and entry.usage.resumes == 1
    assert entry.error.startswith("the worker process died; the request was running at 2 "
                                  "failures in a row")
    h.run_until_idle()
    h.assert_idle()


def test_an_abandoned_step_resumes_running_requests_and_the_next_step_releases_them():
    """The worker still holds the requests of a step it answered too late (and any
    released while it ran): the next Step releases them all, then prefills the
    resumed ones again, so no KV slot leaks."""
    h = Harness(kv_capacity=256)
    h.token_fn = by_position
    h.add(*[make_request(rid, n=3 + rid, max_new=20) for rid in (1, 2, 3)])
    for _ in range(3):
        h.run_step()
    step = h.schedule()
    h.abort(3)                                    # released by the next Step
    h.add(make_request(4, n=5, max_new=3))        # waits
    h.abandon(step, "the worker is unresponsive")
    assert h.final[3].finish_reason == "abort" and 1 not in h.final and 4 not in h.final
    assert sorted(h.batch) == [1, 2, 3]           # the worker's state after its late answer
    nxt = h.run_step()
    assert sorted(nxt.releases) == [1, 2, 3] and prefilled(nxt) == [4]
    assert sorted(prefilled(h.run_step())) == [1, 2]   # once the worker dropped them
    h.run_until_idle()
    want = _undisturbed([make_request(rid, n=3 + rid, max_new=20) for rid in (1, 2)],
                        kv_capacity=256)
    assert h.output(1) == want[1] and h.output(2) == want[2]
    assert h.final[4].finish_reason == "length" and not h.batch
    h.assert_idle()


def test_fail_step_keeps_waiting_requests():
    h = Harness(max_running_requests=1)
    h.add(make_request(1, max_new=10), make_request(2, max_new=2))
    step = h.schedule()
    h.fail(step)
    assert 1 not in h.final and 2 not in h.final
    step = h.run_step()
    assert prefilled(step) == [1] and step.releases == []   # resumed first, alone
    h.run_until_idle()
    assert h.final[1].finish_reason == "length" and h.final[2].finish_reason == "length"


def test_fail_step_forgets_cached_prefixes():
    h = Harness()
    run_to_finish(h, make_request(1, n=10, max_new=2))
    assert h.s.kv.tree.total_size == 11
    h.add(make_request(2, prompt=prompt_of(1, 10)))
    step = h.schedule()
    assert len(step.prefills[0].prefix_slot_ids) == 9
    h.fail(step)
    assert h.s.kv.tree.total_size == 0 and h.s.kv.allocator.num_free == 64
    [p] = h.run_step().prefills                   # 2, resumed
    assert p.prefix_slot_ids == [] and len(p.input_ids) == 10
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 9    # what its first admission reused


def _chunked_decoding_retracted_and_waiting() -> Harness:
    """Requests in every state, a step in flight: 2 and 3 decode, 4 prefills in
    chunks, 1 was retracted (it has output and waits), 5 never started."""
    h = Harness(kv_capacity=96, chunked_prefill_size=8, max_running_requests=3,
                decode_headroom=0)
    h.add(*[make_request(rid, n=6, max_new=40) for rid in (1, 2, 3)])
    for _ in range(3):
        h.run_step()
    h.s._retract(h.s.running[1])
    h.add(make_request(4, n=30, max_new=4), make_request(5, n=4, max_new=4))
    h.run_step()
    assert h.s.running[4].prefilling and sorted(h.s.running) == [2, 3, 4]
    assert not h.s.running[2].prefilling and h.s.running[2].behind == 1
    assert [r.rid for r in h.s.waiting] == [1, 5] and h.output(1)
    return h


def test_reset_worker_resumes_running_requests_and_books_no_slot():
    h = _chunked_decoding_retracted_and_waiting()
    h.schedule()                                  # in flight when the worker dies
    h.worker_dies("the worker process died")
    assert not h.final and not h.s.running
    assert h.s.kv.allocator.num_free == h.cap and h.s.kv.tree.total_size == 0
    assert h.s.stats()["used_slots"] == 0 and h.s.stats()["free_slots"] == h.cap
    assert [r.rid for r in h.s.waiting] == [2, 3, 4, 1, 5]
    assert h.s.stats()["resumes"] == 3


def test_after_a_reset_waiting_requests_run_on_the_new_worker_from_scratch():
    """Nothing is released to the new worker, no cached prefix is reused, and a
    retracted request continues its output where it stopped."""
    h = _chunked_decoding_retracted_and_waiting()
    before = list(h.output(1))
    h.worker_dies()
    step = h.schedule()
    assert step.releases == [] and step.decode_rids == []
    assert 2 in prefilled(step)
    assert all(p.prefix_slot_ids == [] for p in step.prefills)
    h.answer(step)
    h.run_until_idle()
    assert h.final[1].finish_reason == "length" and h.output(1)[:len(before)] == before
    assert len(h.output(1)) == 40 and h.final[5].finish_reason == "length"
    h.assert_idle()


def test_a_reset_after_an_abandoned_step_releases_nothing():
    """The hung worker was killed: the releases meant for it are dropped."""
    h = Harness(kv_capacity=128)
    h.add(*[make_request(rid, max_new=20) for rid in (1, 2)])
    h.run_step()
    step = h.schedule()
    h.s.abandon_step(WorkerError(step.step_id, "unresponsive"))
    h.add(make_request(3, max_new=2))
    h.worker_dies()
    assert not h.final                            # 1 and 2 waited (resumed) at this death
    nxt = h.run_step()
    assert nxt.releases == [] and sorted(prefilled(nxt)) == [1, 2, 3]
    h.run_until_idle()
    h.assert_idle()


# ---- rejections ----------------------------------------------------------------------

@pytest.mark.parametrize("n,why", [
    (0, "empty"),
    (20, "context"),        # n == max_context
    (25, "context"),
    (16, "KV cache"),       # n == kv_capacity
    (17, "KV cache"),
])
def test_rejections(n, why):
    h = Harness(kv_capacity=16, max_context=20)
    h.add(make_request(1, n=n))
    entry = h.final[1]
    assert entry.finish_reason == "error" and why in entry.error
    assert entry.token_ids == [] and entry.logprobs == [] and entry.usage is None
    assert not h.s.has_work and h.schedule() is None


def test_token_ids_outside_the_models_vocabulary_are_rejected_alone():
    """One request's bad id must not reach the worker (it would fail the whole step,
    and with it every running request)."""
    h = Harness(vocab_size=100)
    h.add(make_request(1, prompt=[5, 6, 7], max_new=3))
    h.add(make_request(2, prompt=[5, 100, 7]), make_request(3, prompt=[-1, 5]))
    for rid in (2, 3):
        assert h.final[rid].finish_reason == "error" and "vocabulary" in h.final[rid].error
    h.add(make_request(4, prompt=[99, 0], max_new=2))   # both ends of the range are fine
    h.run_until_idle()
    assert len(h.output(1)) == 3 and len(h.output(4)) == 2
    assert all(p.rid in (1, 4) for step in h.steps for p in step.prefills)


def test_constrained_requests_to_a_worker_without_grammars_are_rejected_alone():
    """A worker whose tokenizer llguidance cannot read fails any step carrying a
    grammar (and a worker group ends on a failed step): such requests never reach it."""
    h = Harness(constraints=False)
    h.add(make_request(1, max_new=3))
    h.add(make_request(2, sampling=SamplingParams(grammar="start: /[a-z]+/")))
    assert h.final[2].finish_reason == "error"
    assert "cannot run constrained requests" in h.final[2].error
    h.run_until_idle()
    assert len(h.output(1)) == 3
    assert all(p.rid == 1 for step in h.steps for p in step.prefills)


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
    first = h.run_step()
    h.add(make_request(1, max_new=2))            # same prompt: a prefix hit
    step = h.run_step()
    assert step.releases == [1] and not step.prefills   # the old state goes first
    [p] = h.run_step().prefills
    assert p.rid == 1 and p.prefix_slot_ids == first.prefills[0].new_slot_ids[:3]
    h.run_until_idle()
    assert len(h.output(1)) == 2 and h.final[1].usage.cached_tokens == 3


# ---- stats ---------------------------------------------------------------------------

def test_stats_and_has_work():
    h = Harness(kv_capacity=32, max_running_requests=1)
    h.add(make_request(1, n=4, max_new=3), make_request(2, n=4, max_new=3))

    def stats(waiting, running, free, cached, evictable, used):
        return {"waiting": waiting, "running": running, "retractions": 0, "resumes": 0,
                "capacity": 32,
                "speculative": {"method": "off", "verifies": 0, "draft_tokens": 0,
                                "accepted_tokens": 0},
                "free_slots": free, "cached_slots": cached, "evictable_slots": evictable,
                "page": 1, "free_pages": free,
                "used_slots": used, "pinned_slots": 0, "max_pinned_slots": 8,
                "pins_refused": 0, "pinned_evicted_slots": 0}

    assert h.s.stats() == stats(2, 0, 32, 0, 0, 0)
    h.run_step()                                 # the prompt is cached, locked
    assert h.s.stats() == stats(1, 1, 28, 4, 0, 4)
    h.run_step()                                 # plus one private decode slot
    assert h.s.stats() == stats(1, 1, 27, 4, 0, 5)
    h.run_step()                                 # rid 1 finishes: all of it is evictable
    assert h.s.stats() == stats(1, 0, 26, 6, 6, 0)
    h.run_until_idle()
    assert h.s.stats() == stats(0, 0, 20, 12, 12, 0)
    assert not h.s.has_work


# ---- radix prefix cache ----------------------------------------------------------------

def test_full_prefix_hit():
    h = Harness()
    P = prompt_of(1, 8)
    run_to_finish(h, make_request(1, prompt=P, max_new=1))
    cached = h.steps[0].prefills[0].new_slot_ids
    assert h.s.kv.tree.total_size == 8
    h.add(make_request(2, prompt=P, max_new=3))
    step = h.run_step()
    [p] = step.prefills
    # matched on all but the last input token: that one is computed for its logits
    assert p.prefix_slot_ids == cached[:7] and p.input_ids == [P[7]]
    assert len(p.new_slot_ids) == 1 and p.needs_logits
    assert h.entries[2][0].usage == Usage(prompt_tokens=8, completion_tokens=1, cached_tokens=7)
    # the recomputed last token duplicates a cached slot: it is freed again
    assert h.s.running[2].slot_ids == cached and h.s.running[2].prefix_len == 8
    assert h.s.kv.allocator.num_free == 64 - 8
    h.run_until_idle()
    assert h.final[2].usage == Usage(prompt_tokens=8, completion_tokens=3, cached_tokens=7)
    h.assert_idle()


def test_partial_prefix_hit():
    h = Harness()
    P = prompt_of(1, 8)
    run_to_finish(h, make_request(1, prompt=P, max_new=2))
    cached = h.steps[0].prefills[0].new_slot_ids
    Q = P[:5] + prompt_of(2, 6)
    h.add(make_request(2, prompt=Q, max_new=2))
    [p] = h.run_step().prefills
    assert p.prefix_slot_ids == cached[:5] and p.input_ids == Q[5:]
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 5
    # both continuations are cached below the shared 5 tokens
    assert h.s.kv.tree.total_size == 5 + (3 + 1) + (6 + 1)
    h.assert_idle()


def test_no_hit_for_a_different_first_token():
    h = Harness()
    run_to_finish(h, make_request(1, n=8, max_new=1))
    h.add(make_request(2, prompt=[5] + prompt_of(1, 8)[1:]))
    [p] = h.run_step().prefills
    assert p.prefix_slot_ids == [] and len(p.input_ids) == 8
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 0


def test_prefix_hit_from_a_request_still_running():
    h = Harness(kv_capacity=256)
    P = prompt_of(1, 40)
    h.add(make_request(1, prompt=P, max_new=10))
    first = h.run_step()
    h.add(make_request(2, prompt=P + [5, 6], max_new=3))
    step = h.run_step()
    assert step.decode_rids == [1]
    [p] = step.prefills
    assert p.prefix_slot_ids == first.prefills[0].new_slot_ids and p.input_ids == [5, 6]
    # rid 1's prompt is shared now: cached and locked by both
    tree = h.s.kv.tree
    assert tree.protected_size == 40 + 2 and tree.evictable_size == 0
    h.run_step()
    assert h.final.get(2) is None and h.entries[2][0].usage.cached_tokens == 40
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 40 and len(h.output(1)) == 10
    h.assert_idle()


def test_a_finished_request_caches_its_outputs_too():
    """A follow-up turn (prompt + answer + more) reuses the answer's KV as well."""
    h = Harness()
    h.token_fn = by_position
    P = prompt_of(1, 6)
    run_to_finish(h, make_request(1, prompt=P, max_new=4))
    answer = h.output(1)
    h.add(make_request(2, prompt=P + answer + [5, 6]))
    [p] = h.run_step().prefills
    assert len(p.prefix_slot_ids) == 6 + 3       # the last answer token has no KV
    assert p.input_ids == [answer[-1], 5, 6]
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 9


def test_a_prefix_is_shared_by_many_running_requests():
    h = Harness(kv_capacity=256)
    P = prompt_of(1, 20)
    run_to_finish(h, make_request(1, prompt=P, max_new=1))
    h.add(*[make_request(rid, prompt=P + [rid], max_new=5) for rid in range(2, 7)])
    step = h.run_step()
    assert prefilled(step) == [2, 3, 4, 5, 6]
    assert all(p.prefix_slot_ids == h.steps[0].prefills[0].new_slot_ids for p in step.prefills)
    assert all(p.input_ids == [p.rid] for p in step.prefills)
    h.run_until_idle()
    assert all(h.final[rid].usage.cached_tokens == 20 for rid in range(2, 7))
    h.assert_idle()


def test_radix_cache_disabled():
    h = Harness(disable_radix_cache=True)
    assert h.s.kv.tree is None
    P = prompt_of(1, 8)
    for rid in (1, 2):                            # the same prompt twice: no hit
        h.add(make_request(rid, prompt=P, max_new=3))
        h.run_until_idle()
        assert h.s.kv.allocator.num_free == 64    # nothing is kept
        assert h.final[rid].usage.cached_tokens == 0
    h.add(make_request(3, prompt=P, max_new=2), make_request(4, prompt=P, max_new=2))
    h.run_until_idle()
    assert all(p.prefix_slot_ids == [] for s in h.steps for p in s.prefills)
    assert h.s.stats()["cached_slots"] == 0
    h.assert_idle()


def test_longest_cached_prefix_first():
    h = Harness(max_running_requests=1)
    P = prompt_of(1, 10)
    run_to_finish(h, make_request(1, prompt=P, max_new=1))
    h.add(make_request(2, n=6, max_new=1),
          make_request(3, prompt=P + [5], max_new=1),        # hit 10
          make_request(4, n=6, max_new=1),
          make_request(5, prompt=P[:6] + [5, 6], max_new=1),  # hit 6
          make_request(6, prompt=P + [7, 8], max_new=1))      # hit 10, later
    order = []
    while (step := h.run_step()) is not None:
        order += prefilled(step)
    assert order == [3, 6, 5, 2, 4]


def test_a_request_without_a_cache_hit_is_not_starved_by_later_hits():
    """Longest prefix first would pass over a request without a hit for as long as
    requests with hits keep arriving; after LPM_OVERTAKE_LIMIT of them it goes first."""
    h = Harness(max_running_requests=1, kv_capacity=4096)
    P = prompt_of(1, 10)
    run_to_finish(h, make_request(1, prompt=P, max_new=1))
    h.add(make_request(2, n=6, max_new=1))   # no cache hit
    order = []
    for rid in range(100, 100 + LPM_OVERTAKE_LIMIT + 1):   # a hit arrives every step
        h.add(make_request(rid, prompt=P + [5 + rid % 7], max_new=1))
        order += prefilled(h.run_step())
    assert order[:LPM_OVERTAKE_LIMIT] == list(range(100, 100 + LPM_OVERTAKE_LIMIT))
    assert order[LPM_OVERTAKE_LIMIT] == 2
    h.run_until_idle()
    h.assert_idle()


def test_fcfs_when_more_than_lpm_queue_limit_requests_wait():
    h = Harness(max_running_requests=1, kv_capacity=4096)
    P = prompt_of(1, 10)
    run_to_finish(h, make_request(1, prompt=P, max_new=1))
    rids = list(range(2, LPM_QUEUE_LIMIT + 4))    # 130 waiting; the last one has a hit
    h.add(*[make_request(rid, n=2, max_new=1) for rid in rids[:-1]])
    h.add(make_request(rids[-1], prompt=P + [5], max_new=1))
    order = []
    for _ in range(4):
        order += prefilled(h.run_step())
    # 130 and 129 waiting: FCFS; then 128: the hit goes first
    assert order == [rids[0], rids[1], rids[-1], rids[2]]


@pytest.mark.parametrize("shared,deferred", [
    (SHARED_PREFIX_WAIT - 1, False), (SHARED_PREFIX_WAIT, True), (100, True)])
def test_a_request_sharing_a_long_prefix_with_a_prefill_waits_a_step(shared, deferred):
    h = Harness(kv_capacity=512)
    S = prompt_of(9, shared)
    h.add(make_request(1, prompt=S + [1, 1], max_new=3),
          make_request(2, prompt=S + [2, 2], max_new=3),
          make_request(3, n=5, max_new=3))               # a stranger is not held back
    step = h.run_step()
    if not deferred:
        assert prefilled(step) == [1, 2, 3]
        assert h.final.get(2) is None and h.entries[2][0].usage.cached_tokens == 0
        return
    assert prefilled(step) == [1, 3]
    step = h.run_step()
    [p] = step.prefills
    assert p.rid == 2 and p.input_ids == [2, 2]
    assert p.prefix_slot_ids == h.steps[0].prefills[0].new_slot_ids[:shared]
    assert h.entries[2][0].usage.cached_tokens == shared
    h.run_until_idle()
    h.assert_idle()


def test_the_defer_rule_counts_only_what_the_tree_lacks():
    h = Harness(kv_capacity=512)
    S = prompt_of(9, 70)
    run_to_finish(h, make_request(1, prompt=S[:40], max_new=1))   # 40 of 70 cached
    h.add(make_request(2, prompt=S + [2], max_new=2),
          make_request(3, prompt=S + [3], max_new=2))       # 70 - 40 < 32 more: no wait
    step = h.run_step()
    assert prefilled(step) == [2, 3]
    assert [len(p.prefix_slot_ids) for p in step.prefills] == [40, 40]
    # both computed S[40:]: the tree keeps one copy and the other is freed
    tree = h.s.kv.tree
    assert tree.total_size == 70 + 2 and h.s.kv.allocator.num_free == 512 - 72
    h.run_until_idle()
    h.assert_idle()


def test_lru_eviction_of_cached_prefixes_for_a_new_request():
    h = Harness(kv_capacity=64)
    A, B = prompt_of(1, 20), prompt_of(2, 20)
    run_to_finish(h, make_request(1, prompt=A, max_new=1))
    run_to_finish(h, make_request(2, prompt=B, max_new=1))
    assert h.s.kv.allocator.num_free == 24
    h.add(make_request(3, n=30, max_new=1))      # 30 > 24 free: evict 6 or more
    h.run_until_idle()
    assert h.s.num_retractions == 0
    h.add(make_request(4, prompt=A, max_new=1), make_request(5, prompt=B, max_new=1))
    h.run_until_idle()
    assert h.final[4].usage.cached_tokens == 0     # A, the least recently used, went
    assert h.final[5].usage.cached_tokens == 19
    assert len(h.prefills_of(5)[0].prefix_slot_ids) == 19


def test_decodes_evict_cached_prefixes_before_retracting_anyone():
    h = Harness(kv_capacity=64)
    run_to_finish(h, make_request(1, n=30, max_new=1))
    h.add(make_request(2, n=4, max_new=20), make_request(3, n=4, max_new=20))
    h.run_until_idle()
    assert h.s.num_retractions == 0 and not h.retracted
    assert all(len(h.output(rid)) == 20 for rid in (2, 3))
    assert h.s.kv.tree.total_size == 2 * (4 + 19)   # rid 1's prompt was evicted
    h.assert_idle()


# ---- chunked prefill -------------------------------------------------------------------

def chunk_lengths(n, size):
    return [size] * (n // size) + ([n % size] if n % size else [])


@pytest.mark.parametrize("size,n", [(1, 5), (7, 15), (7, 20), (7, 21), (64, 129), (64, 100)])
def test_chunked_prefill(size, n):
    h = Harness(kv_capacity=512, chunked_prefill_size=size)
    h.token_fn = by_position
    h.add(make_request(1, n=3, max_new=50))
    while not h.output(1):                       # chunked too, when size < 3
        h.run_step()
    h.add(make_request(2, n=n, max_new=3))
    chunks = []
    while not chunks or not chunks[-1].needs_logits:
        step = h.run_step()
        assert step.decode_rids == [1]           # decodes go on beside the chunks
        [p] = step.prefills
        assert p.rid == 2 and p.num_generated == 0
        chunks.append(p)
        if not p.needs_logits:                   # no token before the last chunk
            assert h.output(2) == []
    assert [len(p.input_ids) for p in chunks] == chunk_lengths(n, size)
    assert [p.needs_logits for p in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum((p.input_ids for p in chunks), []) == prompt_of(2, n)
    for i, p in enumerate(chunks):               # each chunk reads the chunks before it
        assert p.prefix_slot_ids == sum((q.new_slot_ids for q in chunks[:i]), [])
    assert h.output(2) == [by_position(2, n)]
    assert h.run_step().decode_rids == [1, 2]
    h.run_until_idle()
    assert h.output(2) == [by_position(2, n + i) for i in range(3)]
    assert h.final[2].usage == Usage(prompt_tokens=n, completion_tokens=3, cached_tokens=0)
    h.assert_idle()


def test_a_last_chunk_of_one_token_is_a_prefill_not_a_decode():
    h = Harness(kv_capacity=512, chunked_prefill_size=7)
    h.add(make_request(1, n=15, max_new=2))
    steps = [h.run_step() for _ in range(3)]
    assert [[len(p.input_ids) for p in s.prefills] for s in steps] == [[7], [7], [1]]
    assert all(s.decode_rids == [] for s in steps)
    last = steps[-1].prefills[0]
    assert last.input_ids == [prompt_of(1, 15)[-1]] and last.needs_logits
    assert len(last.prefix_slot_ids) == 14
    assert h.run_step().decode_rids == [1]


def test_chunked_prefill_after_a_prefix_hit():
    h = Harness(kv_capacity=512, chunked_prefill_size=8)
    P = prompt_of(1, 20)
    run_to_finish(h, make_request(1, prompt=P, max_new=1))
    h.add(make_request(2, prompt=P + prompt_of(2, 19), max_new=2))
    chunks = []
    while not chunks or not chunks[-1].needs_logits:
        chunks += h.run_step().prefills
    assert [len(p.prefix_slot_ids) for p in chunks] == [20, 28, 36]
    assert [len(p.input_ids) for p in chunks] == [8, 8, 3]
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 20


def test_a_chunked_prompt_is_shared_while_it_is_still_being_prefilled():
    h = Harness(kv_capacity=512, chunked_prefill_size=16, max_prefill_tokens=20,
                cached_token_cost=0)
    P = prompt_of(1, 48)
    h.add(make_request(1, prompt=P, max_new=2))
    first = h.run_step()
    assert [len(p.input_ids) for p in first.prefills] == [16]
    h.add(make_request(2, prompt=P[:16] + [5], max_new=2))
    step = h.run_step()                          # rid 1's next chunk, and rid 2
    assert prefilled(step) == [1, 2]
    assert step.prefills[1].prefix_slot_ids == first.prefills[0].new_slot_ids
    h.run_until_idle()
    h.assert_idle()


def test_one_request_prefills_in_chunks_at_a_time():
    h = Harness(kv_capacity=512, chunked_prefill_size=8, max_prefill_tokens=10,
                cached_token_cost=0)
    h.add(make_request(1, n=30, max_new=2), make_request(2, n=2, max_new=2),
          make_request(3, n=30, max_new=2), make_request(4, n=1, max_new=2))
    step = h.run_step()
    assert [(p.rid, len(p.input_ids)) for p in step.prefills] == [(1, 8), (2, 2)]
    for _ in range(2):                           # rid 3 would need a chunk: all wait
        step = h.run_step()
        assert [(p.rid, len(p.input_ids)) for p in step.prefills] == [(1, 8)]
    step = h.run_step()                          # rid 1's last chunk: rid 3 may start
    assert [(p.rid, len(p.input_ids), p.needs_logits) for p in step.prefills] == [
        (1, 6, True), (3, 4, False)]
    step = h.run_step()
    assert [(p.rid, len(p.input_ids)) for p in step.prefills] == [(3, 8), (4, 1)]
    h.run_until_idle()
    assert all(len(h.output(rid)) == 2 for rid in (1, 2, 3, 4))


def test_chunked_prefill_without_the_radix_cache_reads_its_own_chunks():
    h = Harness(kv_capacity=64, chunked_prefill_size=5, disable_radix_cache=True)
    h.add(make_request(1, n=12, max_new=2))
    chunks = [h.run_step().prefills[0] for _ in range(3)]
    assert [len(p.prefix_slot_ids) for p in chunks] == [0, 5, 10]
    assert chunks[2].prefix_slot_ids == chunks[0].new_slot_ids + chunks[1].new_slot_ids
    h.run_until_idle()
    assert h.s.kv.allocator.num_free == 64


def test_abort_in_the_middle_of_a_chunked_prefill():
    h = Harness(kv_capacity=512, chunked_prefill_size=8)
    h.add(make_request(1, n=30, max_new=2))
    chunks = [h.run_step().prefills[0] for _ in range(2)]
    h.abort(1)
    assert h.final[1].finish_reason == "abort" and h.final[1].token_ids == []
    assert h.final[1].usage == Usage(prompt_tokens=30, completion_tokens=0, cached_tokens=0)
    step = h.run_step()
    assert step.releases == [1] and not step.prefills
    assert h.run_step() is None
    h.assert_idle()
    # the two chunks it computed are cached
    h.add(make_request(2, prompt=prompt_of(1, 30)))
    [p] = h.run_step().prefills
    assert p.prefix_slot_ids == chunks[0].new_slot_ids + chunks[1].new_slot_ids


# ---- retraction ------------------------------------------------------------------------

@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_retraction_under_memory_pressure(radix):
    h = Harness(kv_capacity=64, max_running_requests=8, disable_radix_cache=not radix)
    h.token_fn = by_position
    rids = range(1, 7)
    h.add(*[make_request(rid, n=4, max_new=40) for rid in rids])
    h.run_until_idle()
    assert h.s.num_retractions >= 3 and len(h.retracted) == h.s.num_retractions
    for rid in rids:                             # every request completes, seamlessly
        assert h.final[rid].finish_reason == "length"
        assert h.output(rid) == [by_position(rid, 4 + i) for i in range(40)]
        assert h.final[rid].usage == Usage(prompt_tokens=4, completion_tokens=40, cached_tokens=0)
    for step_id, rid in h.retracted:             # released in the step that retracted it
        step = h.steps[step_id - 1]
        assert rid in step.releases and rid not in step.decode_rids
        assert rid not in prefilled(step)
    # each retraction is resumed once: prefilled with everything it had, and the
    # number of tokens it had sampled (the worker keys its sampler on it)
    assert len(h.resumes) == h.s.num_retractions
    for rid, generated, tokens in h.resumes:
        assert 0 < generated < 40
        assert tokens == prompt_of(rid, 4) + h.output(rid)[:generated]
    if not radix:                                # recomputed from scratch
        resumed = [p for s in h.steps for p in s.prefills if p.num_generated]
        assert all(p.prefix_slot_ids == [] and len(p.input_ids) == 4 + p.num_generated
                   for p in resumed)
    h.assert_idle()


def test_the_request_with_the_least_progress_is_retracted():
    h = Harness(kv_capacity=64)
    h.add(make_request(1, n=4, max_new=60))
    for _ in range(5):
        h.run_step()
    h.add(make_request(2, n=4, max_new=60))      # fewer outputs from now on
    while not h.retracted:
        h.run_step()
    assert [rid for _, rid in h.retracted] == [2]
    h.run_until_idle()
    assert len(h.output(1)) == 60 and len(h.output(2)) == 60


def test_retraction_ties_go_to_the_request_holding_more_kv():
    h = Harness(kv_capacity=64)
    h.add(make_request(1, n=4, max_new=50), make_request(2, n=10, max_new=50))
    while not h.retracted:
        h.run_step()
    assert [rid for _, rid in h.retracted] == [2]    # both have the same output count
    h.run_until_idle()
    assert len(h.output(1)) == 50 and len(h.output(2)) == 50


def test_a_retracted_request_resumes_from_its_cached_kv():
    h = Harness(kv_capacity=4096, decode_cache_tokens=512)
    h.token_fn = by_position
    h.add(make_request(1, n=250, max_new=20), make_request(2, n=4, max_new=20))
    h.run_until_idle()
    assert h.retracted == [(7, 1)]
    [first, resumed] = h.prefills_of(1)
    had = 250 + 6
    assert resumed.num_generated == 6 and resumed.input_ids == [h.output(1)[5]]
    assert len(resumed.prefix_slot_ids) == had - 1
    assert resumed.prefix_slot_ids[:250] == first.new_slot_ids
    assert h.final[1].usage.cached_tokens == 0     # the first admission's hit


def test_a_retracted_request_that_fits_alone_is_resumed():
    """rid 2 is retracted (decode width) with 256 tokens, 255 of them cached. Alone it
    fits the pool (250 + 15 - 1 <= 270), but resuming it asks for its last token plus
    16 slots of headroom beside its locked prefix (17 > 270 - 255): it must still
    resume once rid 1 is gone, and must not block rid 3 behind it."""
    h = Harness(kv_capacity=270, decode_cache_tokens=512, chunked_prefill_size=128)
    h.token_fn = by_position
    h.add(make_request(1, n=4, max_new=12), make_request(2, n=250, max_new=15))
    while not h.retracted:
        h.run_step()
    assert h.retracted == [(8, 2)]
    h.add(make_request(3, n=2, max_new=2))
    h.run_until_idle(limit=200)
    assert h.output(2) == [by_position(2, 250 + i) for i in range(15)]
    assert len(h.output(3)) == 2
    h.assert_idle()


def test_a_request_retracted_while_prefilling_in_chunks():
    h = Harness(kv_capacity=64, chunked_prefill_size=4)
    h.token_fn = by_position
    h.add(make_request(1, n=4, max_new=40))
    for _ in range(21):
        h.run_step()
    h.add(make_request(2, n=40, max_new=3))
    while not h.retracted:
        h.run_step()
    [(step_id, rid)] = h.retracted
    assert rid == 2 and h.output(2) == [] and not h.s.waiting[0].prefilling
    assert h.s.waiting[0].status is Status.WAITING
    before = [p for s in h.steps[:step_id - 1] for p in s.prefills if p.rid == 2]
    assert not any(p.needs_logits for p in before)
    h.run_until_idle()
    after = [p for s in h.steps[step_id:] for p in s.prefills if p.rid == 2]
    assert after and all(p.num_generated == 0 for p in after)
    computed = sum((p.new_slot_ids for p in before), [])
    assert 0 < len(after[0].prefix_slot_ids) < len(computed)    # part of it survived
    assert after[0].prefix_slot_ids == computed[:len(after[0].prefix_slot_ids)]
    assert h.output(2) == [by_position(2, 40 + i) for i in range(3)]
    assert len(h.output(1)) == 40
    h.assert_idle()


def test_abort_of_a_retracted_request():
    h = Harness(kv_capacity=64)
    h.add(make_request(1, n=4, max_new=60), make_request(2, n=10, max_new=55))
    while not h.retracted:
        h.run_step()
    assert h.s.waiting[0].rid == 2
    h.abort(2)
    final = h.final[2]
    assert final.finish_reason == "abort" and final.token_ids == []
    assert final.usage.completion_tokens == len(h.output(2)) > 0
    h.run_until_idle()
    assert h.prefills_of(2)[-1].num_generated == 0       # never resumed
    assert all(2 not in s.releases for s in h.steps[h.retracted[0][0]:])
    h.assert_idle()


# ---- randomized soak -----------------------------------------------------------------

SOAK_LIMITS = [
    dict(kv_capacity=48, max_context=40, max_running_requests=4, max_prefill_tokens=16,
         chunked_prefill_size=8),
    dict(kv_capacity=100, max_context=500, max_running_requests=8, max_prefill_tokens=64,
         chunked_prefill_size=7),
    dict(kv_capacity=200, max_context=80, max_running_requests=16),
    dict(kv_capacity=128, max_context=100, max_running_requests=3, max_prefill_tokens=10,
         chunked_prefill_size=1),
    dict(kv_capacity=300, max_context=64, max_running_requests=32, max_prefill_tokens=40,
         chunked_prefill_size=16, disable_radix_cache=True),
    dict(kv_capacity=700, max_context=400, max_running_requests=8, decode_cache_tokens=768,
         chunked_prefill_size=64),
    dict(kv_capacity=80, max_context=1000, max_running_requests=64, max_prefill_tokens=32,
         chunked_prefill_size=12),
    dict(kv_capacity=64, max_context=1000, max_running_requests=5, max_prefill_tokens=20,
         chunked_prefill_size=5, disable_radix_cache=True),
]


@pytest.mark.parametrize("seed", range(len(SOAK_LIMITS)))
def test_randomized_soak(seed):
    rng = random.Random(seed)
    h = Harness(**SOAK_LIMITS[seed])
    cap, max_context = h.cap, h.s.limits.max_context

    def token(rid, pos):
        value = hash((seed, rid, pos)) % 100
        return EOS if value < 1 else 10 + value

    h.token_fn = token
    # Longest prompt + output that can always run alone (longer ones would meet the
    # lone-request bugs exercised by dedicated tests above).
    longest = min(cap - HEADROOM, h.s.decode_cache_tokens // 256 * 256 - 1)
    bases = [prompt_of(900 + i, rng.randint(1, 40)) for i in range(4)]
    asked: dict[int, TokenizedRequest] = {}
    aborted, failed = set(), defaultdict(int)   # rid -> failed steps it ran in
    next_rid = 1

    def new_prompt():
        kind = rng.random()
        if kind < 0.15 and asked:                  # an earlier prompt again
            return list(rng.choice(list(asked.values())).input_ids)
        if kind < 0.25 and h.final:                # a follow-up turn
            rid = rng.choice(list(h.final))
            return list(asked[rid].input_ids) + h.output(rid) + [1500]
        if kind < 0.7:                             # a shared "system prompt"
            base = rng.choice(bases)
            return base[:rng.randint(1, len(base))] + [
                rng.randrange(1000, 2000) for _ in range(rng.randint(0, 12))]
        return [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 20))]

    for _ in range(400):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4])):
            prompt = new_prompt()
            if rng.random() < 0.05:                # rejected
                prompt = rng.choice([[], [5] * max(cap, min(max_context, 2000))])
            elif len(prompt) >= longest:
                prompt = prompt[:longest - 1]
            room = min(longest - len(prompt), max_context - len(prompt),
                       rng.choice([8, 30, 300]))
            msg = make_request(next_rid, prompt=prompt, max_new=rng.randint(1, max(1, room)))
            asked[next_rid] = msg
            h.add(msg)
            next_rid += 1
        step = h.schedule()
        for _ in range(rng.choice([0, 0, 0, 0, 1, 2])):
            rid = rng.randrange(1, next_rid + 3)
            if rid in asked and rid not in h.final:
                aborted.add(rid)
            h.abort(rid)
        if step is not None:
            if rng.random() < 0.01:
                for rid in h.s.running:
                    failed[rid] += 1
                h.fail(step, f"failure in step {step.step_id}")
            else:
                h.answer(step)
    h.run_until_idle()
    h.assert_idle()
    assert set(h.final) == set(asked)
    reasons = defaultdict(int)
    for rid, msg in asked.items():
        final, out, n = h.final[rid], h.output(rid), len(msg.input_ids)
        reasons[final.finish_reason] += 1
        if final.usage is None:                    # rejected up front
            assert final.finish_reason == "error" and out == []
            assert n == 0 or n >= cap or n >= max_context
            continue
        assert out == [token(rid, n + i) for i in range(len(out))]   # no gap, no repeat
        assert EOS not in out[:-1]
        if final.finish_reason == "length":
            assert len(out) == min(msg.max_new_tokens, max_context - n)
        elif final.finish_reason == "stop":
            assert out[-1] == EOS
        elif final.finish_reason == "abort":
            assert rid in aborted
        else:
            assert failed[rid] >= 2 and "failure in step" in final.error
    assert reasons["length"] and reasons["stop"] and reasons["abort"]
    assert h.steps and sum(len(s.prefills) for s in h.steps) >= len(asked) / 2


def test_the_default_decode_budget_holds_any_request_the_pool_holds():
    """decode_cache_tokens defaults to a row as long as the pool, rounded to 256."""
    h = Harness(kv_capacity=300, max_running_requests=1)
    assert h.s.decode_cache_tokens == 512
    h.add(make_request(1, n=260, max_new=30))
    h.run_until_idle()
    assert h.final[1].finish_reason == "length" and len(h.output(1)) == 30


def test_cached_prefix_tokens_count_against_the_step_budget():
    """With cached_token_cost 0.25, a 32-token prefix costs 8 of the budget: requests
    with 32 cached + 4 new tokens cost 12, so a budget of 40 admits three per step."""
    h = Harness(kv_capacity=1024, max_prefill_tokens=40, cached_token_cost=0.25)
    shared = prompt_of(1, 32)
    run_to_finish(h, make_request(1, prompt=shared + [3], max_new=1))
    h.add(*[make_request(rid, prompt=shared + prompt_of(rid, 4), max_new=2)
            for rid in range(2, 8)])
    sizes = []
    while (step := h.run_step()) is not None:
        if step.prefills:
            sizes.append(len(step.prefills))
            assert all(len(p.prefix_slot_ids) == 32 for p in step.prefills)
    assert sizes == [3, 3]
    h.assert_idle()


def test_a_huge_cached_prefix_still_gets_admitted():
    """A prefix that alone costs more than the budget does not block its request."""
    h = Harness(kv_capacity=1024, max_prefill_tokens=8, chunked_prefill_size=64,
                cached_token_cost=0.25)
    long = prompt_of(1, 100)
    run_to_finish(h, make_request(1, prompt=long, max_new=1))
    h.add(make_request(2, prompt=long + [5, 6], max_new=2))
    h.run_until_idle()
    assert len(h.output(2)) == 2 and h.final[2].usage.cached_tokens >= 99


# ---- what the worker's penalties and min_tokens are sent ----------------------------

def test_penalised_requests_carry_their_context_with_every_last_prefill_chunk():
    """The worker rebuilds a penalised row's counts from the last chunk of each
    admission, a resumed one included: prompt tail, output so far, and the stop ids
    while min_tokens still holds them back. Plain requests carry none of it."""
    h = Harness(kv_capacity=64, max_running_requests=8)
    h.token_fn = by_position
    penalised = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=30)
    h.add(*[make_request(rid, n=24 if rid == 1 else 4, max_new=40, stop=(EOS, 3),
                         sampling=penalised if rid % 2 else None) for rid in range(1, 7)])
    h.run_until_idle()
    last_chunks = [p for s in h.steps for p in s.prefills if p.needs_logits]
    def unseeded(p):   # the scheduler gives every request a seed
        return dataclasses.replace(p.sampling, seed=None)

    assert any(p.num_generated for p in last_chunks if unseeded(p) == penalised)
    for p in last_chunks:
        if unseeded(p) != penalised:
            assert (p.prompt_tail, p.output_ids, p.stop_token_ids) == ([], [], [])
            continue
        prompt = prompt_of(p.rid, 24 if p.rid == 1 else 4)
        assert p.prompt_tail == prompt[-REPETITION_CONTEXT:]
        assert p.output_ids == h.output(p.rid)[:p.num_generated]
        assert p.stop_token_ids == ([2, 3] if p.num_generated < 30 else [])
    for p in (p for s in h.steps for p in s.prefills if not p.needs_logits):
        assert (p.prompt_tail, p.output_ids, p.stop_token_ids) == ([], [], [])
    h.assert_idle()


def test_every_request_gets_a_seed_from_the_scheduler_and_a_given_seed_is_kept():
    """All ranks of a worker group sample alike only if every request brings its
    seed: the scheduler draws one for those that have none."""
    h = Harness()
    h.add(make_request(1, n=4, max_new=2, sampling=SamplingParams(temperature=0.8)),
          make_request(2, n=4, max_new=2, sampling=SamplingParams(temperature=0.8, seed=7)))
    h.run_until_idle()
    seeds = {p.rid: p.sampling.seed for s in h.steps for p in s.prefills}
    assert seeds[2] == 7 and isinstance(seeds[1], int) and 0 <= seeds[1] < 2**63
