"""The paged decode attention (worker_proc/decode_pages.py) against a dense reference,
and the hook that routes mlx_lm's attention to it.

Exactness of whole models decoding in pages against mlx_lm is checked by every runner
and server test (pages are the default layout); these check the pieces alone: rows of
very different lengths, pages shared out in any order, sliding windows, attention
sinks, grouped-query heads, and what happens to a model the hook cannot reach."""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxd.worker_proc import decode_pages
from mlxd.worker_proc.decode_pages import (
    PageArena, PagedLayerCache, install_hook, paged_attention, step_pairs,
)
from mlxd.worker_proc.kv_pool import KVPool
from mlxd.worker_proc.decode import UnsupportedModel, decode_page_for
from mlxd.worker_proc.model_runner import probe_geometry, runner_for
from support import dense_reference, load_reference

PAGE = 8


def arena_with(rows_kv, heads, dim, rng):
    """An arena holding each row's KV `[heads, n, dim]` in pages handed out in a
    shuffled order; returns (arena, tables)."""
    total = sum(-(-k.shape[1] // PAGE) for k, _ in rows_kv)
    arena = PageArena(1, heads, dim, dim, mx.float32, total + 3, PAGE)
    order = list(range(1, arena.pages + 1))
    rng.shuffle(order)
    arena._free = order
    tables = []
    for k, v in rows_kv:
        table = arena.allocate(-(-k.shape[1] // PAGE))
        for j, p in enumerate(table):
            arena.write_run(0, p, k[:, j * PAGE:(j + 1) * PAGE], v[:, j * PAGE:(j + 1) * PAGE])
        tables.append(table)
    return arena, tables


def page_of(arena, leaf, p):
    """Page p of a leaf's keys: `[heads, page, dim]`."""
    return np.asarray(arena.keys[leaf][0])[:, p * arena.page:(p + 1) * arena.page]


@pytest.mark.parametrize("window", [0, 5, 13])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("sinks", [False, True])
def test_paged_attention_matches_dense_attention(window, heads, sinks):
    rng = random.Random(window * 7 + heads[1])
    hq, hkv = heads
    dim = 16
    lengths = [1, 3, PAGE, PAGE + 1, 5 * PAGE - 1, 40]
    rows_kv = [(mx.random.normal((hkv, n, dim)), mx.random.normal((hkv, n, dim))) for n in lengths]
    arena, tables = arena_with(rows_kv, hkv, dim, rng)
    q = mx.random.normal((len(lengths), hq, 1, dim))
    sink = mx.random.normal((hq,)) if sinks else None
    pairs = step_pairs(tables, lengths, arena, window)
    got = paged_attention(q, arena.keys[0][0], arena.values[0][0], pairs, PAGE, 0.25, sink)
    want = dense_reference(q, [k for k, _ in rows_kv], [v for _, v in rows_kv], 0.25, window,
                           None if sink is None else np.asarray(sink))
    assert got.shape == (len(lengths), hq, 1, dim)
    assert np.allclose(np.asarray(got), want, atol=1e-5)


def test_a_window_reads_only_the_pages_it_overlaps():
    tables = [[4, 9, 2, 7], [5]]
    arena = PageArena(1, 2, 4, 4, mx.float32, 10, PAGE)
    pairs = step_pairs(tables, [30, 3], arena, window=6)
    # row 0 holds positions 0..29; its window 24..29 lies in its 4th page only
    assert pairs.rows.tolist() == [0, 1]
    assert pairs.lhs.tolist() == [0, 1, 2, 3]          # row x heads + head
    assert pairs.rhs.tolist() == [7, 11 + 7, 5, 11 + 5]   # head x (pages + 1) + page
    mask = np.asarray(pairs.mask)[:, 0, 0]
    assert mask[0].tolist() == [True] * 6 + [False] * 2
    assert mask[1].tolist() == [True] * 3 + [False] * 5


def test_the_cache_writes_the_new_position_where_the_batch_says():
    arena = PageArena(2, 2, 4, 4, mx.float32, 4, PAGE)
    at = (mx.array([0, 1], mx.int32), mx.array([3 * PAGE + 5] * 2, mx.int32))   # page 3, position 5
    pairs = step_pairs([[3]], [6], arena)
    cache = PagedLayerCache(arena, 1, mx.array([5]), at, pairs)
    k, v = mx.ones((1, 2, 1, 4)), 2 * mx.ones((1, 2, 1, 4))
    assert cache.update_and_fetch(k, v) == (k, v)
    assert (page_of(arena, 1, 3)[:, 5] == 1).all() and np.asarray(arena.keys[1][0]).sum() == 2 * 4
    assert np.asarray(arena.keys[0][0]).sum() == 0   # another layer untouched
    assert cache.make_mask(1, window_size=4) is None


def test_pages_go_back_and_the_arena_grows_when_asked_for_more():
    arena = PageArena(1, 1, 2, 2, mx.float32, 3, PAGE)
    a = arena.allocate(2)
    assert a == [1, 2]   # lowest first: a run
    arena.write_run(0, a[0], mx.ones((1, 2 * PAGE, 2)), mx.ones((1, 2 * PAGE, 2)))
    b = arena.allocate(3)   # 1 free: grows, keeping what was written
    assert arena.pages >= 5 and len(set(a + b)) == 5
    arena.check_integrity([a, b])
    assert all((page_of(arena, 0, p) == 1).all() for p in a)
    assert not any(page_of(arena, 0, p).any() for p in b)
    arena.free(a)
    arena.check_integrity([b])


def test_the_hook_sends_only_paged_caches_to_the_pages(llama_model):
    model, _ = load_reference(llama_model)
    install_hook(model)
    module = __import__(type(model).__module__, fromlist=["x"])
    assert module.scaled_dot_product_attention is decode_pages.scaled_dot_product_attention
    q, k, v = (mx.random.normal((1, 2, 3, 4)) for _ in range(3))
    plain = decode_pages.scaled_dot_product_attention(q, k, v, cache=None, scale=0.5, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    assert mx.allclose(plain, ref)
    install_hook(model)   # twice: still mlx_lm's function underneath, not the hook itself
    again = decode_pages.scaled_dot_product_attention(q, k, v, cache=None, scale=0.5, mask="causal")
    assert mx.allclose(again, ref)


class DirectAttention:
    """Stands in for a model whose attention calls mx.fast directly: the hook never
    sees its caches."""

    def __init__(self, geometry):
        self.g = geometry

    def __call__(self, tokens, cache=None):
        shape = (tokens.shape[0], self.g.n_kv_heads, tokens.shape[1], self.g.k_head_dim)
        for c in cache:
            k, v = c.update_and_fetch(mx.zeros(shape), mx.zeros(shape))
            mx.fast.scaled_dot_product_attention(k, k, v, scale=1.0)
        return mx.zeros((tokens.shape[0], tokens.shape[1], 10))


def test_a_model_the_hook_cannot_reach_decodes_padded(llama_model):
    model, _ = load_reference(llama_model)
    geometry = probe_geometry(model)
    assert decode_page_for(model, geometry) > 0
    direct = DirectAttention(geometry)
    assert decode_page_for(direct, geometry, "auto") == 0
    with pytest.raises(UnsupportedModel, match="pages"):
        decode_page_for(direct, geometry, "paged")
    with pytest.raises(ValueError, match="decode layout"):
        decode_page_for(model, geometry, "ragged")
    runner = runner_for(model, KVPool(geometry, 256), decode_layout="padded")
    assert runner.decode_page == 0


def test_a_join_reads_each_row_where_its_pages_lie_and_refuses_stray_slots(llama_model):
    """Rows join with the pool pages their slots are in, handed out in runs and alone
    and in no order: each table names them, window by window, and nothing is
    copied; slots not at their page's offsets are refused, not copied anywhere."""
    from mlxd.worker_proc import batch_cache
    from mlxd.worker_proc.decode import JoinGroup, decode_rows
    from mlxd.worker_proc.paged_batch import SlotMismatch

    model, _ = load_reference(llama_model)
    g = probe_geometry(model)
    lengths = [3, 2 * PAGE + 5, PAGE]
    pages = [[12], [3, 9, 8], [5]]
    slots = [[t[p // PAGE] * PAGE + p % PAGE for p in range(n)] for t, n in zip(pages, lengths)]

    def prefilled(lengths):
        width = max(lengths)
        pads = [width - n for n in lengths]
        caches = batch_cache.model_caches(g.cache_layout, pads, pads)
        model(mx.array([[1] * (width - n) + [(7 * i + r) % 50 + 3 for i in range(n)]
                        for r, n in enumerate(lengths)]), cache=caches)
        return caches

    pool = KVPool(g, 12 * PAGE, page=PAGE)
    before = [np.asarray(a) for a in pool.keys[0] + pool.values[0]]
    batch = decode_rows(g, PAGE, pool)
    batch.add([JoinGroup([0, 1, 2], [None] * 3, prefilled(lengths), mx.zeros((3,), mx.int32),
                         slots)])
    assert batch.tables == pages and batch.lengths == lengths
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, pool.keys[0] + pool.values[0]))
    stray = decode_rows(g, PAGE, pool)
    with pytest.raises(SlotMismatch, match="offsets"):
        stray.add([JoinGroup([7], [None], prefilled([3]), mx.zeros((1,), mx.int32),
                             [[PAGE + 1, PAGE + 2, PAGE + 3]])])
    with pytest.raises(SlotMismatch, match="slots"):
        stray.add([JoinGroup([7], [None], prefilled([3]), mx.zeros((1,), mx.int32))])


def test_positions_past_a_rows_slots_are_scratch_and_touch_no_pool_slot(llama_model):
    """A forward whose `slots` name fewer positions than a row computes (a draft
    model's row past its own draft count): the named ones are written at their
    slots, the rest to the arena's page 0 only, and no window is taken for them."""
    from mlxd.worker_proc import batch_cache
    from mlxd.worker_proc.decode import JoinGroup, decode_rows

    model, _ = load_reference(llama_model)
    g = probe_geometry(model)
    lengths, pages = [5, PAGE - 1], [1, 3]
    width = max(lengths)
    pads = [width - n for n in lengths]
    caches = batch_cache.model_caches(g.cache_layout, pads, pads)
    model(mx.array([[1] * (width - n) + [3] * n for n in lengths]), cache=caches)
    pool = KVPool(g, 4 * PAGE, page=PAGE)
    batch = decode_rows(g, PAGE, pool)
    batch.add([JoinGroup([0, 1], [None] * 2, caches, mx.array([4, 4]),
                         [[p * PAGE + i for i in range(n)] for p, n in zip(pages, lengths)])])
    named = [[PAGE + 5, PAGE + 6, PAGE + 7], [3 * PAGE + PAGE - 1]]
    mx.eval(batch.forward(model, [[5, 6], [5, 6]], named), batch.arrays())
    assert batch.direct == named[0] + named[1] + [0, 0]
    assert batch.tables == [[1], [3, 0]]   # row 1's next window: scratch only
    # (the join wrote nothing: the prefill would have written the rows' positions)
    written = np.abs(np.asarray(pool.keys[0][0])).sum(axis=(0, 2)) > 0
    assert set(np.flatnonzero(written).tolist()) == set(named[0] + named[1])


def test_the_arena_is_allocated_once_at_its_first_size():
    """No transient second copy at startup: the peak is the arena itself."""
    mx.eval(mx.zeros((1,)))
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    arena = PageArena(2, 4, 16, 16, mx.float32, 256, PAGE)
    assert mx.get_peak_memory() - before <= arena.nbytes * 1.1


def test_the_arena_grows_one_array_at_a_time():
    """A growth copies the arena: the old arrays are let go of one by one, so the
    peak is the new arena and at most one old array, not both arenas."""
    arena = PageArena(4, 4, 16, 16, mx.float32, 64, PAGE)
    one_old = arena.keys[0][0].nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory() - arena.nbytes
    arena.allocate(arena.num_free + 1)   # doubles
    assert arena.pages == 128
    assert mx.get_peak_memory() - before <= (arena.nbytes + one_old) * 1.05


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_lone_row_in_one_run_is_attended_as_a_slice(window, sinks):
    """One row whose pages are consecutive: the slice path, against the pairs path
    and the dense reference."""
    hq, hkv, dim, n = 8, 2, 16, 3 * PAGE + 3
    k, v = mx.random.normal((hkv, n, dim)), mx.random.normal((hkv, n, dim))
    arena = PageArena(1, hkv, dim, dim, mx.float32, 8, PAGE)
    table = arena.allocate(4)
    assert table == [1, 2, 3, 4]
    arena.write_run(0, table[0], k, v)
    q = mx.random.normal((1, hq, 1, dim))
    sink = mx.random.normal((hq,)) if sinks else None
    pairs = step_pairs([table], [n], arena, window)
    low = max(0, n - window) if window else 0
    sliced = PagedLayerCache(arena, 0, mx.array([n - 1]), None, pairs,
                             (table[0] * PAGE + low, n - low))
    paired = PagedLayerCache(arena, 0, mx.array([n - 1]), None, pairs)
    want = dense_reference(q, [k], [v], 0.25, window, None if sink is None else np.asarray(sink))
    for cache in (sliced, paired):
        assert np.allclose(np.asarray(cache.attend(q, 0.25, sink)), want, atol=1e-5)


# ---- several query positions per row (a verify forward) -------------------

# (positions held, queries): several per row, crossing pages, with no context before
# them (length == queries), and single ones, all in one rectangular batch
MULTI = [(1, 1), (3, 2), (PAGE + 2, 5), (PAGE + 3, PAGE + 3), (5 * PAGE - 1, PAGE + 3),
         (40, 2), (2 * PAGE, 5), (9, 1)]


def assert_matches(got, want, queries):
    """Every real query slot within `atol` of the reference; padding slots finite."""
    got = np.asarray(got)
    assert got.shape == want.shape
    for r, q in enumerate(queries):
        assert np.allclose(got[r, :, :q], want[r, :, :q], atol=1e-4), f"row {r}"
        assert np.isfinite(got[r, :, q:]).all(), f"row {r} padding"


@pytest.mark.parametrize("window", [0, 5, 13])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("sinks", [False, True])
def test_several_queries_per_row_attend_causally(window, heads, sinks):
    rng = random.Random(window * 11 + heads[1])
    hq, hkv = heads
    dim = 16
    lengths, queries = [n for n, _ in MULTI], [q for _, q in MULTI]
    rows_kv = [(mx.random.normal((hkv, n, dim)), mx.random.normal((hkv, n, dim))) for n in lengths]
    arena, tables = arena_with(rows_kv, hkv, dim, rng)
    q = mx.random.normal((len(lengths), hq, max(queries), dim))
    sink = mx.random.normal((hq,)) if sinks else None
    pairs = step_pairs(tables, lengths, arena, window, queries)
    got = paged_attention(q, arena.keys[0][0], arena.values[0][0], pairs, PAGE, 0.25, sink)
    want = dense_reference(q, [k for k, _ in rows_kv], [v for _, v in rows_kv], 0.25, window,
                           None if sink is None else np.asarray(sink), queries)
    assert_matches(got, want, queries)


def test_several_queries_read_each_page_once_per_row():
    """The pairs cover every page any of a row's queries reads, once; a padding slot
    counts what the row's last query does."""
    arena = PageArena(1, 2, 4, 4, mx.float32, 10, PAGE)
    pairs = step_pairs([[4, 9, 2, 7], [5]], [30, 3], arena, window=6, queries=[5, 2])
    # row 0's queries are at 25..29: windows from 20 on, in its 3rd and 4th pages
    assert pairs.rows.tolist() == [0, 0, 1]
    assert pairs.rhs.tolist() == [2, 11 + 2, 7, 11 + 7, 5, 11 + 5]
    mask = np.asarray(pairs.mask)[:, 0, 0]   # [pairs, L, page]
    assert mask.shape == (3, 5, PAGE)
    assert mask[0, 0].tolist() == [False] * 4 + [True] * 4     # query at 25: 20..25
    assert mask[1, 0].tolist() == [True] * 2 + [False] * 6
    assert mask[1, 4].tolist() == [True] * 6 + [False] * 2     # query at 29: 24..29
    assert not mask[0, 4].any()
    # row 1's queries at 1 and 2 (0..1, then 0..2); its padding slots count as the one at 2
    assert mask[2, 0].tolist() == [True] * 2 + [False] * 6
    assert all(m.tolist() == [True] * 3 + [False] * 5 for m in mask[2, 1:])


@pytest.mark.parametrize("window", [0, 5, 13])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("n, slots", [(3 * PAGE + 3, 5), (PAGE + 3, PAGE + 3), (2, 2)])
def test_a_lone_row_with_several_queries_is_attended_as_a_slice(window, sinks, n, slots):
    """The slice path's causal (windowed) mask, the last query at the last key: against
    the pairs path and the dense reference."""
    hq, hkv, dim = 8, 2, 16
    k, v = mx.random.normal((hkv, n, dim)), mx.random.normal((hkv, n, dim))
    arena = PageArena(1, hkv, dim, dim, mx.float32, 8, PAGE)
    table = arena.allocate(-(-n // PAGE))
    arena.write_run(0, table[0], k, v)
    q = mx.random.normal((1, hq, slots, dim))
    sink = mx.random.normal((hq,)) if sinks else None
    pairs = step_pairs([table], [n], arena, window, [slots])
    low = max(0, n - slots + 1 - window) if window else 0   # the first query's window start
    sliced = PagedLayerCache(arena, 0, mx.array([n - slots]), None, pairs,
                             (table[0] * PAGE + low, n - low))
    paired = PagedLayerCache(arena, 0, mx.array([n - slots]), None, pairs)
    want = dense_reference(q, [k], [v], 0.25, window, None if sink is None else np.asarray(sink),
                           [slots])
    for cache in (sliced, paired):
        assert_matches(cache.attend(q, 0.25, sink), want, [slots])


def test_the_cache_writes_every_new_position_of_every_row():
    """B x heads x L positions, flattened (row, head, position), each to the arena row
    `write_at` names for it; then attended, they match the dense reference."""
    heads, dim, slots = 2, 4, 3
    arena = PageArena(2, heads, dim, dim, mx.float32, 6, PAGE)
    tables, lengths = [[5, 2], [3]], [PAGE + 1, slots]   # row 0's queries cross pages
    rows = [table[p // PAGE] * PAGE + p % PAGE
            for table, n in zip(tables, lengths) for _ in range(heads) for p in range(n - slots, n)]
    at = (mx.array([h for _ in tables for h in range(heads) for _ in range(slots)], mx.int32),
          mx.array(rows, mx.int32))
    pairs = step_pairs(tables, lengths, arena, queries=[slots, slots])
    cache = PagedLayerCache(arena, 1, mx.array([n - slots for n in lengths]), at, pairs)
    k = mx.random.normal((2, heads, slots, dim))
    v = mx.random.normal((2, heads, slots, dim))
    assert cache.update_and_fetch(k, v) == (k, v)
    keys, values = np.asarray(arena.keys[1][0]), np.asarray(arena.values[1][0])
    for r, (table, n) in enumerate(zip(tables, lengths)):
        for j, p in enumerate(range(n - slots, n)):
            row = table[p // PAGE] * PAGE + p % PAGE
            assert np.array_equal(keys[:, row], np.asarray(k[r, :, j]))
            assert np.array_equal(values[:, row], np.asarray(v[r, :, j]))
    assert np.count_nonzero(keys.any(-1)) == 2 * heads * slots   # nothing else written
    assert not np.asarray(arena.keys[0][0]).any()                    # another layer untouched
    # row 0's earlier positions, then attend: what was written is what is read
    early = mx.random.normal((heads, PAGE + 1 - slots, dim))
    arena.write_run(1, 5, early, early)
    full = [mx.concatenate([early, k[0]], axis=1), k[1]]
    fullv = [mx.concatenate([early, v[0]], axis=1), v[1]]
    q = mx.random.normal((2, 2 * heads, slots, dim))
    want = dense_reference(q, full, fullv, 0.5, queries=[slots, slots])
    assert_matches(cache.attend(q, 0.5, None), want, [slots, slots])
