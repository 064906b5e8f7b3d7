"""scheduler_proc/disk_tier.py and its use by the scheduler: what KV is spilled to the
disk tier (chained pieces, resumable where a prefill can resume), and what a prompt
reads back, for plain, sliding-window and recurrent models. The harness models the
worker's disk: every spill must name slots holding its tokens, every read writes the
stored KV into the booked slots, and the harness's read-back checks catch any wrong
slot, window or state."""

import pytest

from mlxd.protocol import DiskRun
from mlxd.runtime.kv_disk import entry_name, parse_name
from mlxd.runtime.prefix_hash import PREFIX_BLOCK, block_hashes
from mlxd.runtime.kv_disk import run_name
from mlxd.scheduler_proc.disk_tier import PIECE, DiskTier
from scheduler_harness import Harness, make_request, prompt_of

KINDS = {
    "plain": {},
    "window": {"window": 4, "window_capacity": 256},
    "state": {"state_slots": 4, "snapshot_slots": 16},
}


def harness(kind="plain", **limits) -> Harness:
    limits.setdefault("kv_capacity", 1024)
    limits.setdefault("chunked_prefill_size", 64)
    return Harness(kv_disk=True, **KINDS[kind], **limits)


def hashes_of(tokens: list[int]) -> list[int]:
    """The block hashes the radix tree keeps for `tokens`."""
    return block_hashes(tokens[:len(tokens) - len(tokens) % PREFIX_BLOCK])


def restart(h: Harness) -> None:
    """The worker dies and a new one starts: memory is gone, the disk stays."""
    h.worker_dies()
    h.s.disk_restarted(list(h.disk))


def runs_of(h: Harness) -> list[tuple[int, int, bool]]:
    """(start, length, resumable) of every spill sent so far, in order."""
    out = []
    for step in h.steps:
        for spill in step.spills:
            out.append((spill.run.n_tokens, spill.run.resumable))
    return out


# ---- the plan: what is spilled -----------------------------------------------------

def test_a_finished_prompt_is_spilled_in_whole_blocks_and_chained():
    h = harness()
    h.add(make_request(1, n=100, max_new=4))
    h.run_until_idle()
    assert [n for n, _ in runs_of(h)] == [64, 32]   # the chunk [0, 64), then [64, 96)
    tokens = prompt_of(1, 100)
    names = h.s.kv.disk.index.match(block_hashes(tokens))
    assert sum(parse_name(n)[2] for n in names) == 96 and set(names) == set(h.disk)
    h.assert_idle()


def test_a_long_insert_is_cut_in_pieces_at_multiples_of_the_piece():
    tier = DiskTier([])
    tokens = list(range(2 * PIECE + 100))
    tier.plan(tokens, list(range(1, len(tokens) + 1)), hashes_of(tokens))
    spills = tier.take_spills()
    assert [s.run.n_tokens for s in spills] == [PIECE, PIECE, 96]
    assert spills[1].run.parent == spills[0].run.end   # chained
    assert spills[1].slot_ids[0] == PIECE + 1 and spills[1].tokens[0] == PIECE
    tier.plan(tokens, list(range(1, len(tokens) + 1)), hashes_of(tokens))   # already there
    assert not tier.take_spills()
    longer = tokens + list(range(5000, 5100))
    tier.plan(longer, list(range(1, len(longer) + 1)), hashes_of(longer))
    [more] = tier.take_spills()                        # from where the disk ends
    assert more.run.parent == spills[-1].run.end and more.run.n_tokens == 2240 - 2144


def test_a_gone_entry_is_written_again():
    tier = DiskTier([])
    tokens = list(range(64))
    tier.plan(tokens, list(range(1, 65)), hashes_of(tokens))
    [spill] = tier.take_spills()
    tier.forget([run_name(spill.run)])
    tier.plan(tokens, list(range(1, 65)), hashes_of(tokens))
    assert [s.run for s in tier.take_spills()] == [spill.run]


def test_window_entries_resume_only_where_the_window_is_held():
    tier = DiskTier([], window=4)
    tokens = list(range(40))
    held = [0] * 27 + [5] * 13   # window slots for positions 27..39
    tier.plan(tokens, list(range(1, 41)), hashes_of(tokens), held)
    [spill] = tier.take_spills()                     # [0, 32): needs 27..31: held
    assert spill.run.resumable and spill.window_ids == [5] * 5
    tier2 = DiskTier([], window=4)
    tier2.plan(tokens, list(range(1, 41)), hashes_of(tokens), [0] * 30 + [5] * 10)
    [spill2] = tier2.take_spills()
    assert not spill2.run.resumable and spill2.window_ids == []


def test_state_entries_resume_only_at_a_snapshot_on_a_block_boundary():
    tier = DiskTier([], needs_state=True)
    tier.plan(list(range(48)), list(range(1, 49)), hashes_of(list(range(48))), snapshot=7)
    [spill] = tier.take_spills()
    assert spill.run.resumable and spill.snapshot_slot == 7
    tokens = list(range(100, 150))   # ends at 50: not on a block boundary
    tier.plan(tokens, list(range(1, 51)), hashes_of(tokens), snapshot=8)
    [spill] = tier.take_spills()
    assert not spill.run.resumable and spill.snapshot_slot == 0


def test_names_from_the_worker_are_the_index_and_foreign_names_are_ignored():
    run = DiskRun(0, 11, 16, True)
    tier = DiskTier([run_name(run), "lock", "junk.kv", entry_name(0, 12, 15)])
    assert list(tier.index.entries) == [run_name(run)]


# ---- what the router is told ---------------------------------------------------------

def test_events_tell_where_resumable_entries_end_once_per_hash():
    first = DiskRun(0, 11, 16, True)
    tier = DiskTier([run_name(first), run_name(DiskRun(0, 11, 16, False))])
    assert tier.events.take() == (True, [11], [])   # built from the worker's names
    tokens = list(range(2 * PIECE + 32))
    tier.plan(tokens, list(range(1, len(tokens) + 1)), hashes_of(tokens))
    spills = tier.take_spills()
    reset, stored, removed = tier.events.take()
    assert not reset and not removed and stored == [s.run.end for s in spills]
    tier.forget([run_name(first)])   # another entry still ends at 11
    assert not tier.events
    tier.forget([run_name(DiskRun(0, 11, 16, False))])
    assert tier.events.take() == (False, [], [11])
    tier.announce()
    reset, stored, _ = tier.events.take()
    assert reset and sorted(stored) == sorted(s.run.end for s in spills)


def test_entries_cut_off_from_the_root_are_not_told_until_their_chain_is_whole():
    """A match reads chains from the root: an entry after a gone one (evicted first,
    its write skipped) is no disk hit, so the router must not count it."""
    tokens = list(range(3 * PIECE))
    whole = DiskTier([])
    whole.plan(tokens, list(range(1, len(tokens) + 1)), hashes_of(tokens))
    first, second, third = (run_name(s.run) for s in whole.take_spills())
    ends = [parse_name(n)[1] for n in (first, second, third)]
    whole.events.take()
    whole.forget([second])   # the third is cut off with it
    assert whole.events.take() == (False, [], [ends[1], ends[2]])
    tier = DiskTier([third, first])   # a restart finds the same hole
    assert tier.events.take() == (True, [ends[0]], [])
    tier.plan(tokens, list(range(1, len(tokens) + 1)), hashes_of(tokens))
    assert [run_name(s.run) for s in tier.take_spills()] == [second, third]
    reset, stored, removed = tier.events.take()   # written again: whole once more
    assert not reset and not removed and sorted(stored) == sorted(ends[1:])


@pytest.mark.parametrize("kind", ["window", "state"])
def test_entries_a_prefill_cannot_resume_from_are_not_told(kind):
    tier = DiskTier([], **({"window": 4} if kind == "window" else {"needs_state": True}))
    tier.events.take()
    tokens = list(range(PIECE + 32))
    tier.plan(tokens, list(range(1, len(tokens) + 1)), hashes_of(tokens),
              [7] * len(tokens) if kind == "window" else (), snapshot=9)
    spills = tier.take_spills()
    assert [s.run.resumable for s in spills] == [False, True]
    assert tier.events.take() == (False, [spills[1].run.end], [])


def test_the_scheduler_hands_memory_and_disk_events_to_its_batches():
    h = harness()
    assert h.s.take_cache_events() == {"disk_reset": True, "disk_stored": [],
                                       "disk_removed": []}
    h.add(make_request(1, n=100, max_new=4))
    h.run_until_idle()
    events = h.s.take_cache_events()
    tokens = prompt_of(1, 100)
    assert set(events["cache_stored"]) >= set(hashes_of(tokens))
    assert events["disk_stored"] == [hashes_of(tokens)[3], hashes_of(tokens)[5]]
    assert not h.s.has_cache_events and h.s.take_cache_events() == {}
    restart(h)   # a new worker: what its disk holds, anew
    events = h.s.take_cache_events()
    assert events["disk_reset"] and sorted(events["disk_stored"]) == \
        sorted([hashes_of(tokens)[3], hashes_of(tokens)[5]])


# ---- the match: what is read back --------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_a_prompt_comes_back_from_disk_after_a_restart(kind):
    h = harness(kind)
    h.add(make_request(1, n=300, max_new=5))
    h.run_until_idle()
    first = list(h.output(1))
    restart(h)
    h.add(make_request(1, n=300, max_new=5))
    h.run_until_idle()
    usage = h.final[1].usage
    # the disk holds whole blocks: the prompt's up to 288 (299 in memory)
    want = 288
    assert usage.cached_tokens == usage.disk_tokens == want
    assert h.output(1) == first
    [p] = [p for p in h.prefills_of(1)[-4:] if p.disk_tokens]
    assert p.prefix_slot_ids == [] and p.disk_tokens == want
    h.assert_idle()


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_disk_continues_a_shorter_prefix_in_memory(kind):
    h = harness(kind, kv_capacity=2048)
    h.add(make_request(1, n=400, max_new=3))
    h.run_until_idle()
    restart(h)
    h.add(make_request(2, n=10, max_new=3, prompt=prompt_of(1, 200)))   # memory: 0..~190
    h.run_until_idle()
    h.add(make_request(3, n=0, max_new=3, prompt=prompt_of(1, 400)))
    h.run_until_idle()
    usage = h.final[3].usage
    assert usage.cached_tokens >= 384 and 0 < usage.disk_tokens < usage.cached_tokens
    h.assert_idle()


def test_a_read_that_misses_is_computed_and_counted_as_not_cached():
    h = harness()
    h.add(make_request(1, n=200, max_new=3))
    h.run_until_idle()
    restart(h)
    h.disk_broken = set(h.disk)
    h.add(make_request(2, n=0, max_new=3, prompt=prompt_of(1, 200)))
    h.run_until_idle()
    usage = h.final[2].usage
    assert usage.cached_tokens == usage.disk_tokens == 0
    stats = h.s.stats()["disk"]
    assert stats["hit_tokens"] == stats["missed_tokens"] == 192
    h.assert_idle()


def test_an_evicted_prefix_comes_back_from_disk_without_a_restart():
    h = harness(kv_capacity=600, chunked_prefill_size=512, max_prefill_tokens=512)
    a, b = prompt_of(1, 500), prompt_of(2, 500)
    for rid, ids in enumerate([a, b, a, b], start=1):
        h.add(make_request(rid, n=0, max_new=2, prompt=ids))
        h.run_until_idle()
    for rid in (3, 4):   # each evicted the other's KV from memory: read from disk
        assert h.final[rid].usage.disk_tokens == h.final[rid].usage.cached_tokens == 496
    assert h.output(3) == h.output(1) and h.output(4) == h.output(2)
    h.assert_idle()


def test_gone_entries_are_not_matched():
    h = harness()
    h.add(make_request(1, n=200, max_new=3))
    h.run_until_idle()
    h.worker_dies()
    h.s.disk_restarted(list(h.disk))
    h.disk_gone = sorted(h.disk)[:1]
    h.add(make_request(9, n=10, max_new=2))   # a step that reports the loss
    h.run_until_idle()
    assert h.disk_gone == [] and not set(h.s.kv.disk.index.entries) & set(sorted(h.disk)[:1])


def test_the_last_piece_of_a_window_or_state_prompt_stops_at_a_block_boundary():
    for kind in ("window", "state"):
        h = harness(kind, chunked_prefill_size=512)
        h.add(make_request(1, n=100, max_new=2))
        h.run_until_idle()
        assert [len(p.input_ids) for p in h.prefills_of(1)] == [96, 4]
    h = harness("plain", chunked_prefill_size=512)
    h.add(make_request(1, n=100, max_new=2))
    h.run_until_idle()
    assert [len(p.input_ids) for p in h.prefills_of(1)] == [100]


def test_match_takes_the_longest_chain_not_the_first_run():
    tier = DiskTier([])
    tokens = list(range(3 * PREFIX_BLOCK))
    hashes = block_hashes(tokens)
    short = DiskRun(0, hashes[0], 16, True)            # [0, 16): a dead end
    long_ = DiskRun(0, hashes[1], 32, True)            # [0, 32) ...
    tail = DiskRun(hashes[1], hashes[2], 16, True)     # ... then [32, 48)
    tier = DiskTier([run_name(r) for r in (short, long_, tail)])
    hit = tier.match(hashes, cached=0, limit=47)
    assert hit is not None and hit.runs == [long_, tail] and hit.end == 47
    assert tier.match(hashes, cached=47, limit=47) is None
    later = tier.match(hashes, cached=40, limit=47)
    assert later is not None and later.runs == [tail] and later.start == 32
