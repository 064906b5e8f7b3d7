"""The float tail of quantized decode pages (decode_pages, paged_batch): each row's
newest positions attended from a float ring, the older ones from the quantized pages.

Checked alone: the attention over pages below each row's tail start and its ring
from there, against a dense reference over exactly those values (the ring's stale
entries and the pages' positions inside the tail filled with garbage, so a read of
either shows); and in a batch decoding a real model: what the rings hold after
joins, decode steps and verifies that reject drafts, and that with a tail as long
as every row the decode is the float pages' decode."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlxd.worker_proc import batch_cache
from mlxd.worker_proc.decode import JoinGroup, decode_rows
from mlxd.worker_proc.decode_pages import (
    PageArena, install_hook, paged_attention, step_pairs, tail_pairs, tail_ring,
)
from mlxd.worker_proc.kv_pool import KVPool
from mlxd.worker_proc.model_runner import probe_geometry
from support import dense_reference, load_reference

PAGE = 8


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("sinks", [False, True])
def test_pages_below_the_tail_and_the_ring_from_it(slots, window, sinks):
    """Rows shorter than the tail (no page pair), longer, and one whose ring lost
    its oldest positions to rejected drafts (its tail starts later): each attends
    the quantized values below its start and the float ones from it."""
    heads, hq, dim, keep = 2, 4, 32, 5
    ring = tail_ring(keep, 8)
    rng = np.random.default_rng(slots + window + sinks)
    arena = PageArena(1, heads, dim, dim, mx.float32, 16, PAGE, k_bits=8, v_bits=8,
                      float_tail=keep, max_rows=4)
    fmt_k, fmt_v = arena.k_format, arena.v_format
    lengths = [3, 40, 27]
    lows = [0, 40 - keep, 27 - 2]   # the last: a short tail
    tables = [arena.allocate(-(-n // PAGE)) for n in lengths]
    rings = arena.tail.allocate(len(lengths))
    want_k, want_v = [], []
    for table, r, n, low in zip(tables, rings, lengths, lows):
        k = rng.standard_normal((heads, n, dim)).astype(np.float32)
        v = rng.standard_normal((heads, n, dim)).astype(np.float32)
        # the pages hold garbage where the tail attends, the ring where it does not
        paged_k, paged_v = k.copy(), v.copy()
        paged_k[:, low:] = paged_v[:, low:] = 9.0
        for i, page in enumerate(table):
            span = slice(i * PAGE, min(n, (i + 1) * PAGE))
            arena.write_run(0, page, mx.array(paged_k[:, span]), mx.array(paged_v[:, span]))
        # what the pages hold, as values
        at_rows = np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in table])[:n]
        stored_k = np.asarray(fmt_k.decode(arena.keys[0]))[:, at_rows]
        stored_v = np.asarray(fmt_v.decode(arena.values[0]))[:, at_rows]
        held = np.arange(max(0, n - ring), n)
        ring_k, ring_v = k[:, held].copy(), v[:, held].copy()
        stale = held < low
        ring_k[:, stale] = ring_v[:, stale] = -7.0
        at = mx.array(np.tile(r * ring + held % ring, heads), mx.int32)
        head_ids = mx.array(np.repeat(np.arange(heads), len(held)), mx.int32)
        arena.write_tail(0, head_ids, at, mx.array(ring_k.reshape(-1, dim)),
                         mx.array(ring_v.reshape(-1, dim)))
        want_k.append(np.concatenate([stored_k[:, :low], k[:, low:]], axis=1))
        want_v.append(np.concatenate([stored_v[:, :low], v[:, low:]], axis=1))
    queries = [min(slots, n) for n in lengths]
    lows = [np.full(max(queries), low) for low in lows]   # every query slot alike
    pairs = step_pairs(tables, lengths, arena, window, queries, below=lows)
    assert 0 not in np.asarray(pairs.rows)   # the short row reads its ring only
    tail = (arena.tail.keys[0][0], arena.tail.values[0][0],
            tail_pairs(rings, lengths, lows, arena.tail, window, queries))
    q = mx.random.normal((len(lengths), hq, max(queries), dim), key=mx.random.key(slots))
    sink = mx.random.normal((hq,), key=mx.random.key(9)) if sinks else None
    got = paged_attention(q, arena.keys[0], arena.values[0], pairs, PAGE, 0.3, sink,
                          fmt_k, fmt_v, tail)
    want = dense_reference(np.asarray(q), want_k, want_v, 0.3, window,
                     np.asarray(sink) if sinks else None, queries)
    for r, n in enumerate(queries):
        assert np.allclose(np.asarray(got)[r, :, :n], want[r, :, :n], atol=1e-4), r


def test_a_row_attended_only_from_its_ring():
    """Every row inside its tail: no page pairs at all."""
    arena = PageArena(1, 1, 32, 32, mx.float32, 4, PAGE, k_bits=8, v_bits=8, float_tail=16)
    table, [r] = arena.allocate(1), arena.tail.allocate(1)
    k = mx.random.normal((1, 5, 32))
    arena.write_run(0, table[0], k, k)
    arena.write_tail(0, mx.zeros((5,), mx.int32), mx.arange(5) + r * arena.tail.page,
                     k[0], k[0])
    pairs = step_pairs([table], [5], arena, below=[[0]])
    assert pairs.rows.shape[0] == 0
    q = mx.random.normal((1, 1, 1, 32))
    got = paged_attention(q, arena.keys[0], arena.values[0], pairs, PAGE, 1.0, None,
                          arena.k_format, arena.v_format,
                          (arena.tail.keys[0][0], arena.tail.values[0][0],
                           tail_pairs([r], [5], [[0]], arena.tail)))
    want = dense_reference(np.asarray(q), [np.asarray(k)], [np.asarray(k)], 1.0, queries=[1])
    assert np.allclose(np.asarray(got), want, atol=1e-5)


# ---- in a batch, on a real model ----------------------------------------------

ROOM = 8   # pages each row of `joined` may fill


def slot_of(row: int, position: int) -> int:
    """Where `joined` keeps row `row`'s position: its own run of ROOM pages."""
    return (1 + row * ROOM) * PAGE + position


def joined(model, geometry, lengths, bits: int = 0, **tail):
    """A PagedDecodeBatch of rows prefilled over `lengths` tokens, their KV in a pool
    of PAGE-position pages (`bits`: quantized) at `slot_of`; `tail`: decode_rows'
    float tail settings (rings with room for verifies of 8 drafts unless said)."""
    install_hook(model)
    g = replace(geometry, k_bits=bits, v_bits=bits)
    width = max(lengths)
    pads = [width - n for n in lengths]
    caches = batch_cache.model_caches(g.cache_layout, pads, pads)
    tokens = mx.array([[1] * (width - n) + [(7 * i + r) % 50 + 3 for i in range(n)]
                       for r, n in enumerate(lengths)])
    logits = model(tokens, cache=caches)[:, -1, :]
    pool = KVPool(g, (1 + len(lengths) * ROOM) * PAGE, page=PAGE)
    for leaf, cache in enumerate(batch_cache.kv_leaves(g.cache_layout, caches)):
        for r, n in enumerate(lengths):
            k, v = batch_cache.row_columns(cache, r, width - n, width)
            pool.write(leaf, mx.array([slot_of(r, p) for p in range(n)]),
                       k.swapaxes(0, 1), v.swapaxes(0, 1))
    batch = decode_rows(g, PAGE, pool, **{"tail_slack": 8, **tail})
    batch.add([JoinGroup(list(range(len(lengths))), [None] * len(lengths), caches,
                         mx.argmax(logits, axis=-1),
                         [[slot_of(r, p) for p in range(n)] for r, n in enumerate(lengths)])])
    return batch


def forward(batch, model, drafts=None):
    """`batch.forward`, every new position at its `slot_of`."""
    queries = [1 + len(d) for d in drafts] if drafts else [1] * len(batch.lengths)
    return batch.forward(model, drafts, [[slot_of(r, n + j) for j in range(q)] for r, (n, q)
                                         in enumerate(zip(batch.lengths, queries))])


def ring_positions(batch, row, leaf):
    """Row `row`'s ring, out of the stored basis: `[heads, ring, dim]` by index."""
    tail = batch.arena.tail
    r = batch.rings[row]
    k = tail.keys[leaf][0][:, r * tail.page:(r + 1) * tail.page]
    return np.asarray(batch.arena.k_format.rotate(k, back=True))


def check_the_tail_reads_what_was_written(batch, float_batch):
    """After a forward: every ring entry the attention counts (for any row, query
    slot and layer kind) holds the keys the first layer wrote at the position it
    stands for (the first layer's KV depends on the tokens only: the float batch's
    pages hold them)."""
    batch.check_integrity()
    ring = batch.arena.tail.page
    counted = np.asarray(batch._leaves[0].tail[1].mask).reshape(len(batch.lengths), -1, ring)
    for row, n in enumerate(batch.lengths):
        held = ring_positions(batch, row, 0)
        base = n - ring
        at = base + (np.arange(ring) - base) % ring   # the position each index stands for
        for j in np.flatnonzero(counted[row].any(axis=0)):
            p = at[j]
            want = np.asarray(float_batch.pool.keys[0][0][:, slot_of(row, p)])
            assert np.allclose(held[:, j], want, atol=1e-5), (row, p)


@pytest.mark.parametrize("slack", [8, 2])
def test_the_tail_reads_only_what_its_rings_hold(llama_model, slack):
    """Decode steps and verifies (drafts within the ring's slack, and longer ones:
    the tail is then cut short) on a quantized batch and a float one fed the same
    tokens, most drafts rejected: after each forward every ring entry attended
    holds its position's KV, and a tail cut short grows back."""
    model, _ = load_reference(llama_model)
    g = probe_geometry(model)
    keep = 6
    batch = joined(model, g, [3, 2 * PAGE + 5, 12], bits=8, float_tail=keep, max_rows=2,
                   tail_slack=slack)
    float_batch = joined(model, g, [3, 2 * PAGE + 5, 12])
    long_draft = list(range(5, 5 + 7))
    cut = False
    for step, drafts in enumerate([None, None, [[4, 4], [], long_draft], None,
                                   [[9], long_draft, [3, 3, 3]], None, None, None, None, None]):
        for b in (batch, float_batch):
            mx.eval(forward(b, model, drafts), b.arrays())
        check_the_tail_reads_what_was_written(batch, float_batch)
        if drafts is not None:
            for b in (batch, float_batch):
                b.accept([1 + (len(d) > 0) for d in drafts], mx.array([5 + step] * 3))
        ring = batch.arena.tail.page
        cut |= any(r - ring > n - keep for n, r in zip(batch.lengths, batch.reached))
    assert cut == (slack < len(long_draft))   # only a verify longer than the slack cuts
    # a tail cut short by the long drafts is whole again
    assert all(r - ring <= n - keep for n, r in zip(batch.lengths, batch.reached))
    batch.remove({1})
    batch.check_integrity()
    assert len(batch.rings) == 2 and batch.arena.tail.num_free == batch.arena.tail.pages - 2


def test_a_verify_attends_as_one_at_a_time_decoding(llama_model):
    """Rows longer than the tail verify drafts, all kept: each position's logits are
    those of decoding its tokens one at a time (each query's tail is the positions
    up to its own), so speculation keeps greedy output exact with --kv-bits."""
    model, _ = load_reference(llama_model)
    g = probe_geometry(model)
    lengths, drafts = [40, 3, 21], [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
    at_once, one_by_one = (joined(model, g, lengths, bits=8, float_tail=6, max_rows=3)
                           for _ in range(2))
    inputs = np.asarray(at_once.tokens)
    verified = np.asarray(forward(at_once, model, drafts)).reshape(3, 5, -1)
    stepped = []
    for j in range(5):
        one_by_one.tokens = mx.array([int(inputs[i]) if j == 0 else drafts[i][j - 1]
                                      for i in range(3)], mx.int32)
        stepped.append(np.asarray(forward(one_by_one, model)))
    stepped = np.stack(stepped, axis=1)
    assert np.abs(verified - stepped).max() < 1e-5


def test_a_tail_as_long_as_the_rows_decodes_as_float_pages(llama_model):
    """Every position in the rings: the quantized pages are never read, and the
    logits are the float pages' (to rounding), verifies included; without the tail
    they are not."""
    model, _ = load_reference(llama_model)
    g = probe_geometry(model)
    lengths = [3, 2 * PAGE + 5, 12]
    runs = {name: joined(model, g, lengths, **kw) for name, kw in [
        ("float", {}), ("tail", dict(bits=8, float_tail=256, max_rows=3)),
        ("pages", dict(bits=8))]}
    gaps = {"tail": 0.0, "pages": 0.0}
    for drafts in [None, [[4, 4], [7], []], None, None]:
        out = {}
        for name, b in runs.items():
            out[name] = np.asarray(forward(b, model, drafts))
            if drafts is not None:
                b.accept([1, 2, 1], mx.array([3, 3, 3]))
        for name in gaps:
            gaps[name] = max(gaps[name], float(np.abs(out[name] - out["float"]).max()))
    assert gaps["tail"] < 1e-4, gaps
    assert gaps["pages"] > 10 * gaps["tail"], gaps
