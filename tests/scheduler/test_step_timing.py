"""Step timing as Stats reports it, and the scheduler's cheap per-step queue ranking."""

import pytest

from mlxd.protocol import SamplingParams, StepTiming, TokenizedRequest
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.scheduler_proc.step_timing import StepTimings


def test_summary_of_a_window():
    t = StepTimings(window=4)
    for i in range(6):   # only the last 4 stay in the window
        t.record(StepTiming(compute_ms=10.0 * i, wait_ms=2.0, idle_ms=1.0, chained_wait_ms=0.0,
                            chained=i % 2 == 0), scheduler_ms=0.5)
    s = t.summary()
    assert s["steps"] == 6 and s["chained_steps"] == 3 and s["window"] == 4
    assert s["compute_ms"]["mean"] == pytest.approx(35.0)
    assert s["compute_ms"]["p50"] == 40.0 and s["compute_ms"]["p90"] == 50.0
    assert s["scheduler_ms"]["mean"] == pytest.approx(0.5)
    assert s["idle_fraction"] == pytest.approx(4 * 1.0 / (4 * 2.0 + 140.0))


def test_a_step_after_a_pause_leaves_its_wait_out():
    """After a step that left nothing running the worker reports no wait: the time
    until the next request is not a round trip and must not count as idle."""
    t = StepTimings()
    t.record(StepTiming(compute_ms=10.0, wait_ms=1.0, idle_ms=0.0), 0.2)
    t.record(StepTiming(compute_ms=12.0), 0.3)   # the first step after a pause
    s = t.summary()
    assert s["wait_ms"]["n"] == 1 and s["wait_ms"]["mean"] == 1.0
    assert s["compute_ms"]["n"] == 2
    assert s["idle_fraction"] == 0.0


def test_empty_timings():
    """(Malformed figures never get here: a StepResult with one is refused when it
    is decoded; tests/protocol/test_protocol.py, TIMING_FIELD_BAD.)"""
    t = StepTimings()
    assert t.summary() == {"steps": 0, "chained_steps": 0, "window": 0}
    t.record(StepTiming(), 0.1)
    s = t.summary()
    assert s["steps"] == 1 and "wait_ms" not in s and s["scheduler_ms"]["n"] == 1


def _request(rid, ids, max_new=4):
    return TokenizedRequest(rid, ids, SamplingParams(), max_new, [])


def test_waiting_requests_keep_their_cached_prefix_fresh_without_rematching():
    """A waiting request's cached prefix counts as used every step (LRU), even when
    its match length comes from the cache because the tree did not change."""
    s = Scheduler(SchedulerLimits(kv_capacity=256, max_context=256))
    tree = s.kv.tree
    a, b = list(range(1, 21)), list(range(100, 120))
    tree.insert(a, s.kv.allocate(20))
    tree.insert(b, s.kv.allocate(20))
    s.add_request(_request(7, a + [50, 51]))
    req = s.waiting[0]
    assert s.waiting.cached_len(req) == 20              # matched: touches a
    tree.insert(b, list(tree.match_prefix(b)[0]))   # b used again; nothing new: same version
    version = tree.version
    assert s.waiting.cached_len(req) == 20 and tree.version == version   # from the cache
    assert req.match_key == (version, req.num_tokens)
    tree.evict(20)                               # the least recently used goes: b
    assert tree.match_prefix(a)[0] and not tree.match_prefix(b)[0]


def test_cached_match_is_recomputed_when_the_tree_changes():
    s = Scheduler(SchedulerLimits(kv_capacity=256, max_context=256))
    s.add_request(_request(1, list(range(1, 30))))
    req = s.waiting[0]
    assert s.waiting.cached_len(req) == 0
    s.kv.tree.insert(list(range(1, 11)), s.kv.allocate(10))
    assert s.waiting.cached_len(req) == 10
    s.kv.tree.evict(10)
    assert s.waiting.cached_len(req) == 0
