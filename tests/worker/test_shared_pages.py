"""Decode pages shared by running rows that start from the same cached prefix
(worker_proc/shared_pages.py): held once, decoded exactly, never shared once the
pool slots they are known by are written again."""

import random

import mlx.core as mx
import pytest

from mlxd.protocol import PrefillInput, SamplingParams, Step
from mlxd.runtime.kv_layout import DECODE_PAGE
from mlxd.worker_proc.decode_pages import PageArena
from mlxd.worker_proc.shared_pages import SharedPages
from test_model_runner import MAX_TOKENS, Driver, assert_matches_reference

OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_pages_are_found_by_their_slots_until_one_is_written():
    shared = SharedPages(4)
    shared.add(7, [10, 11, 12, 13])
    shared.add(8, [14, 15, 16, 17])
    assert shared.find([10, 11, 12, 13]) == 7 and shared.find([14, 15, 16, 17]) == 8
    assert shared.find([10, 11, 12, 14]) == 0          # every slot counts, in order
    assert shared.find([13, 12, 11, 10]) == 0
    shared.written([99, 12])                          # one of page 7's slots
    assert shared.find([10, 11, 12, 13]) == 0 and shared.find([14, 15, 16, 17]) == 8
    shared.add(9, [20, 21, 22, 16])                   # a slot of page 8 listed anew
    assert shared.find([14, 15, 16, 17]) == 0 and shared.find([20, 21, 22, 16]) == 9
    shared.forget([9])
    assert len(shared) == 0
    shared.written([20, 16])                          # nothing left to forget


def test_a_page_held_by_several_rows_goes_back_with_its_last_holder():
    arena = PageArena(1, 1, 2, 2, mx.float32, 4, 8)
    a = arena.allocate(2)
    arena.hold(a[0])
    arena.check_integrity([a, [a[0]]])
    assert arena.free(a) == [a[1]]        # page a[0] is still held by the second row
    arena.check_integrity([[a[0]]])
    assert arena.free([a[0]]) == [a[0]]
    arena.check_integrity([])
    assert arena.num_free == 4


def test_the_arena_grows_by_doubling_up_to_its_most_unless_asked_for_more():
    arena = PageArena(1, 1, 2, 2, mx.float32, 2, 8, max_pages=5)
    arena.allocate(3)
    assert arena.pages == 4
    arena.allocate(1)
    arena.allocate(1)
    assert arena.pages == 5                # doubling stops at the most
    arena.allocate(2)
    assert arena.pages == 7                # more than the most, when rows need it


def shared_prefix_run(path: str, overlap: bool, rows: int = 3,
                      prefix: int = 2 * DECODE_PAGE + 12):
    """Request 0 (prefix + 22 tokens) runs; then `rows` requests join in one step,
    each with the first `prefix` positions of request 0 from the pool and 20 tokens
    of its own. Returns the driver, the prompts and the tables when they joined."""
    d = Driver(path, overlap=overlap)
    first = prompt(1, prefix + 22)
    d.step([d.prefill(0, first)])
    prompts = {0: first}
    joins = []
    for r in range(1, rows + 1):
        own = prompt(100 + r, 20)
        prompts[r] = first[:prefix] + own
        joins.append(d.prefill(r, own, prefix_slots=d.slot_ids[0][:prefix]))
    d.step(joins)
    batch = d.runner.batch
    tables = {rid: list(t) for rid, t in zip(batch.rids, batch.tables)}
    return d, prompts, tables


@OVERLAP
def test_rows_starting_from_one_prefix_hold_its_full_pages_once(llama_model, overlap):
    d, prompts, tables = shared_prefix_run(llama_model, overlap)
    batch, arena = d.runner.batch, d.runner.batch.arena
    full = 2   # the prefix's full pages (the third is part prefix, part the row's own)
    for rid in (1, 2, 3):
        assert tables[rid][:full] == tables[0][:full]
        assert tables[rid][full] not in tables[0]
    arena.check_integrity(batch.tables)
    held = {p for t in batch.tables for p in t}
    assert len(held) == sum(len(t) for t in batch.tables) - 3 * full
    for _ in range(MAX_TOKENS - 1):
        d.step()
    for rid, ids in prompts.items():
        assert_matches_reference(llama_model, ids, d.out[rid])


@OVERLAP
def test_a_shared_page_outlives_the_row_that_wrote_it(llama_model, overlap):
    d, prompts, tables = shared_prefix_run(llama_model, overlap)
    d.step(releases=[0])
    batch, arena = d.runner.batch, d.runner.batch.arena
    arena.check_integrity(batch.tables)
    assert tables[0][0] in batch.tables[0]
    for _ in range(MAX_TOKENS - 2):
        d.step()
    for rid in (1, 2, 3):
        assert_matches_reference(llama_model, prompts[rid], d.out[rid])
    d.step(releases=[1, 2, 3])
    assert arena.num_free == arena.pages and len(batch.shared) == 0


def test_a_slot_handed_out_again_does_not_bring_its_old_page(llama_model):
    """The scheduler frees request 0's slots while it runs (a duplicate of what the
    prefix tree holds) and hands them to request 1 for other tokens at the same
    positions: request 1 must decode its own KV, not request 0's page."""
    d = Driver(llama_model)
    first = prompt(1, DECODE_PAGE + 30)
    d.step([d.prefill(0, first)])
    reused = d.slot_ids[0][:DECODE_PAGE]
    other = prompt(2, DECODE_PAGE + 10)
    own = [next(d.slots) for _ in range(10)]
    d.slot_ids[1] = reused + own
    d.step([PrefillInput(1, other, [], reused + own, SamplingParams())])
    batch = d.runner.batch
    assert batch.tables[1][0] != batch.tables[0][0]
    for _ in range(MAX_TOKENS - 1):
        d.step()
    assert_matches_reference(llama_model, first, d.out[0])
    assert_matches_reference(llama_model, other, d.out[1])


def test_a_window_pool_shares_nothing(hybrid_model):
    """Windowed layers load only their window of a prefix: two rows' pages with the
    same slots may differ there, so a window pool turns sharing off; windowed layers
    kept in the KV pool hold every position, and share."""
    import test_hybrid_runner
    import test_window_pool

    path = hybrid_model("gemma3_text")
    assert test_window_pool.Driver(path).runner.batch.shared is None
    assert test_hybrid_runner.Driver(path).runner.batch.shared is not None


@pytest.mark.parametrize("preallocate", [False, True])
def test_the_arena_starts_small_unless_preallocated(llama_model, preallocate):
    from mlxd.worker_proc.kv_pool import KVPool
    from mlxd.worker_proc.decode import first_pages
    from mlxd.worker_proc.model_runner import probe_geometry, runner_for
    from support import load_reference

    model, _ = load_reference(llama_model)
    runner = runner_for(model, KVPool(probe_geometry(model), 8192), decode_pages=3000,
                         preallocate_pages=preallocate)
    arena = runner.batch.arena
    assert arena.pages == (3000 if preallocate else 375) and arena.max_pages == 3000
    assert first_pages(100) == 64 and first_pages(30) == 30   # at least 64, at most all


def test_a_decode_writing_a_listed_slot_unlists_its_page(llama_model):
    """A slot handed out again as a decode step's slot (where the input token's KV
    goes) unlists the page listed under it, like a prefill's new slot does."""

    d = Driver(llama_model)
    d.step([d.prefill(0, prompt(1, DECODE_PAGE + 30)), d.prefill(1, prompt(2, 5))])
    batch = d.runner.batch
    listed = d.slot_ids[0][:DECODE_PAGE]
    assert batch.shared.find(listed) == dict(zip(batch.rids, batch.tables))[0][0]
    d.runner.run(Step(99, [0, 1], [next(d.slots), listed[7]], [], []))
    assert batch.shared.find(listed) == 0


def test_a_join_that_fails_midway_leaves_nothing_held_after_the_reset(llama_model,
                                                                      monkeypatch):
    d = Driver(llama_model)
    d.step([d.prefill(0, prompt(1, 2 * DECODE_PAGE + 3))])
    arena = d.runner.batch.arena
    calls = []

    def failing(n, real=arena.allocate):
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(n)

    monkeypatch.setattr(arena, "allocate", failing)
    shared = d.slot_ids[0][:2 * DECODE_PAGE]
    with pytest.raises(RuntimeError):
        d.runner.run(Step(50, [0], [next(d.slots)], [
            PrefillInput(1, prompt(2, 10), shared, [next(d.slots) for _ in range(10)],
                         SamplingParams()),
            PrefillInput(2, prompt(3, 10), shared, [next(d.slots) for _ in range(10)],
                         SamplingParams())], []))
    d.runner.reset()   # as the worker does after a failed step
    arena.check_integrity([])
    assert arena.num_free == arena.pages and len(d.runner.batch.shared) == 0


def test_a_growth_that_fails_midway_is_mended_by_the_reset(monkeypatch):
    arena = PageArena(3, 2, 4, 4, mx.float32, 4, 8)
    evals = []
    real_eval = mx.eval

    def failing(*arrays):
        evals.append(1)
        if len(evals) == 3:
            raise RuntimeError("out of memory")
        return real_eval(*arrays)

    monkeypatch.setattr(mx, "eval", failing)
    with pytest.raises(RuntimeError):
        arena.allocate(arena.num_free + 1)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert len({a.shape[1] for parts in arena.keys + arena.values for a in parts}) > 1   # half grown
    arena.reset()
    assert {a.shape[1] for parts in arena.keys + arena.values for a in parts} == {(arena.pages + 1) * 8}
    arena.check_integrity([])
    table = arena.allocate(arena.num_free + 3)   # grows again, every array alike
    assert {a.shape[1] for parts in arena.keys + arena.values for a in parts} == {(arena.pages + 1) * 8}
    arena.check_integrity([table])
