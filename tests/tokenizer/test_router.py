"""tokenizer_proc/router.py and engines.py: the prefix index, the routing policy and
the engine set (pure: no sockets)."""

import random

import pytest

from mlxd.protocol import (Abort, GetStats, SamplingParams, SchedulerReady, Stats,
                           TokenBatch, TokenEntry, TokenizedRequest, Usage)
from mlxd.runtime.prefix_hash import PREFIX_BLOCK, block_hashes
from mlxd.tokenizer_proc.engines import Ended, EngineSet
from mlxd.tokenizer_proc.router import PrefixIndex, RoutePolicy, Router
from support import worker_limits


def ids(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def holds(router: Router, engine: str, tokens: list[int]) -> None:
    router.index.apply(engine, False, block_hashes(tokens), [])


# ---- PrefixIndex ------------------------------------------------------------------

def test_longest_equals_a_linear_scan_on_prefix_closed_holdings():
    rng = random.Random(3)
    for _ in range(200):
        index = PrefixIndex()
        prompt = ids(rng.randrange(5), rng.randrange(0, 200))
        hashes = block_hashes(prompt)
        depth = {}
        for engine in ("a", "b", "c"):   # each holds a prefix of the prompt, or another
            k = rng.randrange(len(hashes) + 1)
            index.apply(engine, False, hashes[:k] + block_hashes(ids(99, 48)), [])
            depth[engine] = k
        best = max(depth.values())
        blocks, engines = index.longest(hashes)
        assert blocks == best
        assert engines == ({e for e, k in depth.items() if k == best} if best else set())


def test_removed_and_reset_hashes_are_forgotten():
    index = PrefixIndex()
    hashes = block_hashes(ids(1))
    index.apply("a", False, hashes, [])
    index.apply("b", False, hashes[:2], [])
    index.apply("a", False, [], hashes[2:])
    assert index.longest(hashes) == (2, {"a", "b"})
    index.apply("b", True, [], [])   # b's cache was dropped
    assert index.longest(hashes) == (2, {"a"})
    index.drop("a")
    assert index.longest(hashes) == (0, set()) and not index.holders


# ---- Router ---------------------------------------------------------------------

def test_a_request_goes_to_the_engine_caching_its_prefix_unless_load_is_imbalanced():
    router = Router(RoutePolicy(balance_abs=4, balance_rel=1.5, min_match=0.5))
    prompt = ids(7, 80)
    holds(router, "b", prompt[:64])
    assert router.choose(prompt, {"a": 0, "b": 3}) == ("b", "cache")
    assert router.choose(prompt, {"a": 0, "b": 5}) == ("a", "load")   # 5 - 0 > 4
    assert router.choose(ids(8, 80), {"a": 1, "b": 0}) == ("b", "load")   # no match
    # too short a match (16 of 80 tokens < 0.5): the least-loaded engine
    holds(router, "c", prompt[:16])
    assert router.choose(prompt, {"a": 0, "c": 0}) == ("a", "load")
    assert router.decisions == {"cache": 1, "load": 3}


def test_only_the_chosen_engine_s_load_diverts_a_cached_request():
    router = Router(RoutePolicy(balance_abs=4))
    prompt = ids(9, 64)
    holds(router, "b", prompt)
    # another engine is far busier than the idlest: b's conversation stays on b
    assert router.choose(prompt, {"a": 0, "b": 2, "c": 40}) == ("b", "cache")
    # overloaded when both hold: 5 more than the idlest and more than 1.5 times as many
    assert router.choose(prompt, {"a": 0, "b": 6}) == ("a", "load")
    assert router.choose(prompt, {"a": 20, "b": 26}) == ("b", "cache")   # 26 < 1.5 * 20


def test_the_threshold_defaults_to_the_first_engine_s_batch():
    engines = EngineSet(Router(RoutePolicy(balance_abs=0)))
    engines.join("e0", SchedulerReady(worker_limits(), 8))
    assert engines.router.policy.balance_abs == 8
    fixed = EngineSet(Router(RoutePolicy(balance_abs=3)))
    fixed.join("e0", SchedulerReady(worker_limits(), 8))
    assert fixed.router.policy.balance_abs == 3


def test_ties_go_to_the_engine_caching_least_and_the_other_policies():
    router = Router()
    holds(router, "a", ids(1, 160))
    assert router.choose(ids(2), {"a": 0, "b": 0})[0] == "b"
    rr = Router(RoutePolicy(kind="round_robin"))
    picks = [rr.choose(ids(3), {"a": 9, "b": 0, "c": 0})[0] for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
    ll = Router(RoutePolicy(kind="least_load"))
    holds(ll, "a", ids(4))
    assert ll.choose(ids(4), {"a": 1, "b": 0}) == ("b", "load")


def on_disk(router: Router, engine: str, tokens: list[int], ends: list[int]) -> None:
    """`engine`'s disk entries end after the given blocks of `tokens`."""
    hashes = block_hashes(tokens)
    router.disk.apply(engine, False, [hashes[k - 1] for k in ends], [])


def test_deepest_finds_the_last_held_block_of_holdings_that_are_not_prefix_closed():
    index = PrefixIndex()
    hashes = block_hashes(ids(2, 20 * PREFIX_BLOCK))
    index.apply("a", False, [hashes[3], hashes[11]], [])
    index.apply("b", False, [hashes[11], hashes[17]], [])
    assert index.longest(hashes) == (0, set())
    assert index.deepest(hashes) == (18, {"b"})
    assert index.deepest(hashes[:15]) == (12, {"a", "b"})
    assert index.deepest(block_hashes(ids(3, 64))) == (0, set())


def test_a_prompt_goes_where_memory_or_disk_holds_most_of_it():
    router = Router(RoutePolicy(balance_abs=4, min_match=0.5))
    prompt = ids(11, 20 * PREFIX_BLOCK)
    holds(router, "a", prompt[:8 * PREFIX_BLOCK])
    on_disk(router, "b", prompt, [4, 16])
    assert router.choose(prompt, {"a": 0, "b": 1}) == ("b", "disk")   # 16 blocks > 8
    on_disk(router, "a", prompt, [16])
    assert router.choose(prompt, {"a": 1, "b": 0}) == ("b", "disk")   # both: the idler
    holds(router, "a", prompt[:16 * PREFIX_BLOCK])
    assert router.choose(prompt, {"a": 1, "b": 0}) == ("a", "cache")  # a tie: memory
    assert router.choose(prompt, {"b": 0, "c": 0}) == ("b", "disk")   # a is down
    assert router.choose(prompt, {"a": 0, "b": 6}) == ("a", "cache")
    router.forget("a")
    assert router.choose(prompt, {"a": 0, "b": 9}) == ("a", "load")   # b: overloaded
    assert router.choose(prompt, {"a": 0, "b": 0}) == ("b", "disk")
    assert router.decisions == {"disk": 4, "cache": 2, "load": 1}


# ---- EngineSet --------------------------------------------------------------------

def ready(**limits) -> SchedulerReady:
    return SchedulerReady(worker_limits(**limits), 64)


def request(rid: int, prompt: list[int]) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(), 8, [])


def entry(rid: int, tokens=(5,), finish=None) -> TokenEntry:
    return TokenEntry(rid, list(tokens), [0.0] * len(tokens), finish_reason=finish)


def two_engines() -> EngineSet:
    engines = EngineSet()
    assert engines.join("e0", ready()) is None and engines.join("e1", ready()) is None
    return engines


def test_choices_share_an_engine_and_aborts_follow_their_request():
    engines = two_engines()
    first = request(1, ids(1))
    choices = [first, TokenizedRequest(2, first.input_ids, SamplingParams(seed=1), 8, [])]
    out, ended = engines.dispatch(choices + [request(3, ids(2))])
    assert not ended
    assert out[0][0] == out[1][0] != out[2][0]   # the third goes to the idle engine
    assert engines.router.decisions["affinity"] == 1
    aborts, _ = engines.dispatch([Abort(2), Abort(99)])
    assert aborts == [(out[1][0], Abort(2))]
    engines.check_integrity()


def test_a_lost_engine_s_requests_go_on_elsewhere_started_ones_resumed_from_their_tokens():
    engines = two_engines()
    out, _ = engines.dispatch([request(1, ids(1)), request(2, ids(2)),
                               request(3, ids(3)), request(4, ids(4))])
    on_e1 = sorted(m.rid for e, m in out if e == "e1")
    started, unstarted = on_e1
    batch = engines.on_batch("e1", TokenBatch([entry(started, [5]), entry(started, [6, 7])]))
    assert [e.rid for e in batch.entries] == [started, started]
    resend, ended = engines.lost("e1")
    assert ended == []
    moved = {m.rid: m for e, m in resend}
    assert [e for e, _ in resend] == ["e0", "e0"] and sorted(moved) == on_e1
    assert moved[started].output_ids == [5, 6, 7] and moved[started].resumes == 1
    assert moved[started].input_ids == ids(started)   # the prompt as it was
    assert moved[unstarted].output_ids == []
    assert moved[unstarted].resumes == 1   # run again whole, the loss counted
    assert engines.router.decisions["resume"] == 1 and engines.router.decisions["rerun"] == 1
    # a late batch of the lost engine is not its to report any more
    assert engines.on_batch("e1", TokenBatch([entry(unstarted)])).entries == []
    assert engines.on_batch("e0", TokenBatch([entry(unstarted, finish="length")])).entries
    engines.check_integrity()
    assert engines.engines["e0"].load == 3
    assert engines.merged_stats({})["router"]["resumes"] == 1


def test_a_request_running_at_a_second_loss_ends_with_an_error_naming_the_engine():
    engines = two_engines()
    out, _ = engines.dispatch([request(1, ids(1))])
    first = out[0][0]
    engines.on_batch(first, TokenBatch([entry(1, [5])]))
    [(second, resumed)], _ = engines.lost(first)
    engines.on_batch(second, TokenBatch([entry(1, [6])]))
    engines.join(first, ready())
    resend, [end] = engines.lost(second)
    assert resend == [] and end.rid == 1 and end.reason == "error"
    assert f"({second}) was lost" in end.message and "2 failures in a row" in end.message
    engines.check_integrity()


def test_a_request_that_streamed_nothing_ends_at_its_second_loss_too():
    """A prompt that kills every engine it reaches is not run a third time."""
    engines = two_engines()
    out, _ = engines.dispatch([request(1, ids(1))])
    [(second, rerun)], _ = engines.lost(out[0][0])
    assert rerun.output_ids == [] and rerun.resumes == 1
    resend, [end] = engines.lost(second)
    assert resend == [] and end.reason == "error" and "2 failures in a row" in end.message


def test_a_resume_by_the_scheduler_counts_toward_the_second_loss():
    """Its usage said the request was resumed after a worker's death already."""
    engines = two_engines()
    out, _ = engines.dispatch([request(1, ids(1))])
    resumed = TokenEntry(1, [5], [0.0], usage=Usage(64, 3, 0, resumes=1))
    engines.on_batch(out[0][0], TokenBatch([resumed]))
    _, [end] = engines.lost(out[0][0])
    assert end.reason == "error"


def test_while_no_engine_is_up_requests_wait_parked_until_one_joins_or_time_runs_out():
    now = [0.0]
    engines = EngineSet(park_seconds=10, clock=lambda: now[0])
    engines.join("e0", ready())
    out, _ = engines.dispatch([request(1, ids(1)), request(2, ids(2))])
    engines.on_batch("e0", TokenBatch([entry(1, [5])]))
    assert engines.lost("e0") == ([], [])
    assert engines.parked == 2 and engines.expire() == []
    out, ended = engines.dispatch([request(3, ids(3)), Abort(2)])
    assert out == [] and ended == [Ended(2, "abort", None)] and engines.parked == 2
    engines.check_integrity()
    now[0] = 5.0
    engines.join("e0", ready())                    # the restarted engine
    resend = engines.unpark()
    assert sorted((m.rid, m.output_ids) for _, m in resend) == [(1, [5]), (3, [])]
    assert engines.parked == 0 and engines.expire() == []
    assert engines.router.decisions["resume"] == 1 and engines.router.decisions["rerun"] == 0
    # gone again (1 was resumed once: it ends), and no engine joins within park_seconds
    _, [end] = engines.lost("e0")
    assert end.rid == 1 and end.reason == "error"
    now[0] = 14.9
    assert engines.expire() == []
    now[0] = 15.0
    [end] = engines.expire()
    assert end.rid == 3 and end.reason == "error" and "within 10 s" in end.message
    assert engines.parked == 0
    engines.check_integrity()


def test_an_aborted_request_whose_engine_is_lost_ends_as_aborted():
    engines = two_engines()
    out, _ = engines.dispatch([request(1, ids(1))])
    engines.dispatch([Abort(1)])
    resend, ended = engines.lost(out[0][0])
    assert resend == [] and ended == [Ended(1, "abort", None)]
    engines.check_integrity()


def test_stats_are_merged_once_every_engine_answered_or_left():
    engines = two_engines()
    out, _ = engines.dispatch([GetStats(7)])
    assert sorted(e for e, _ in out) == ["e0", "e1"]
    assert engines.on_stats("e0", Stats(7, {"running": 2, "worker_status": "ok"})) == []
    [(target, merged)] = engines.on_stats("e1", Stats(7, {
        "running": 3, "speculative": {"method": "ngram", "verifies": 4}}))
    assert target == "" and merged.stats["running"] == 5
    assert merged.stats["speculative"] == {"method": "ngram", "verifies": 4}
    assert merged.stats["worker_status"] == "ok"
    assert sorted(merged.stats["engines"]) == ["e0", "e1"]
    engines.dispatch([GetStats(8)])
    engines.on_stats("e0", Stats(8, {"running": 1}))
    resend, _ = engines.lost("e1")
    assert [m.stats["running"] for _, m in resend] == [1]


@pytest.mark.parametrize("limits", [dict(vocab_size=999), dict(kv_capacity=100),
                                    dict(max_context=64)])
def test_an_engine_that_cannot_serve_every_admitted_request_is_refused(limits):
    engines = EngineSet()
    engines.join("e0", ready())
    assert engines.join("e1", ready(**limits))
    assert engines.up == ["e0"]


def test_cache_events_in_batches_steer_the_next_request():
    engines = two_engines()
    prompt = ids(5, 10 * PREFIX_BLOCK)
    engines.on_batch("e1", TokenBatch([], cache_stored=block_hashes(prompt)))
    out, _ = engines.dispatch([request(1, prompt + [1, 2, 3])])
    assert out[0][0] == "e1"
    engines.on_batch("e1", TokenBatch([], cache_reset=True))
    engines.on_batch("e0", TokenBatch([], cache_stored=block_hashes(prompt)))
    out, _ = engines.dispatch([request(2, prompt)])
    assert out[0][0] == "e0"


def test_disk_events_in_batches_steer_the_next_request_until_the_engine_is_lost():
    engines = two_engines()
    prompt = ids(6, 10 * PREFIX_BLOCK)
    engines.on_batch("e1", TokenBatch([], disk_reset=True,
                                      disk_stored=[block_hashes(prompt)[9]]))
    out, _ = engines.dispatch([request(1, prompt)])
    assert out[0][0] == "e1" and engines.router.decisions["disk"] == 1
    engines.on_batch("e1", TokenBatch([entry(1, finish="stop")]))
    engines.on_batch("e1", TokenBatch([], disk_removed=[block_hashes(prompt)[9]]))
    assert not engines.router.disk.holders
    engines.on_batch("e1", TokenBatch([], disk_stored=[block_hashes(prompt)[9]]))
    engines.lost("e1")
    assert not engines.router.disk.holders
