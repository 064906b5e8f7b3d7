"""Decode without padding: the running rows' KV in pages, attended where it lies.

A store of pages (the KV pool, kv_pool.py, or a `PageArena`) holds, per KV leaf,
keys and values `[heads, (pages + 1) * P, dim]`, head-major (a head's page is P
consecutive rows; P = kv_layout's DECODE_PAGE), page 0 never handed out. A running
row's page table names the pages holding its positions in order; the page ids are
the same in every leaf. A decode step writes each row's new position into its page
(a scatter of one position per row and head), then attends, per (row, page) pair,
the row's queries to that page in place with `mx.gather_mm` (scores, then weights x
values), and merges each row's pairs by their softmax's log-sum-exp; a lone row
whose pages are one run is attended as one slice instead. A verify forward
(speculative decoding) gives each row several consecutive query positions at once:
all are written first, then each query attends causally (the positions up to its
own), every page read once per row for all of them. A step's cost follows the pages
the rows hold, not the longest row. The decode batch (paged_batch) reads the pool;
its `PageArena` has page 0 (padding and scratch positions) and the float tails.

The model stays mlx_lm's own module. Its attention layers call
`scaled_dot_product_attention(queries, keys, values, cache=..., ...)` from the
module they are defined in; `install_hook` replaces that name (where it is
mlx_lm's `base` function) with one that sends a `PagedLayerCache` to its own
`attend` and anything else to mlx_lm's function. The cache object is what the
model sees: `offset` (each row's position, for RoPE), `update_and_fetch` (writes
the new position, returns it), `make_mask` (None: the pages' masks are built here).
A model whose attention does not go through that name (a layer calling mx.fast
directly) is found by `paged_batch.paged_decode_reaches`, and decodes in the padded
layout instead.

Sliding-window layers attend only the pages that overlap their window, masked to
the window's positions; attention sinks (gpt_oss) join the log-sum-exp merge.

Quantized pages (--kv-bits) keep a float tail (--kv-float-tail T): each row also
holds its newest positions in float, in a ring of its own (a page of the arena's
`tail`, `tail_ring` positions, position p at index p mod the ring's size, stored
in the quantized pages' rotated basis). Every new position is written to both;
each query attends the T positions up to its own (fewer after a verify longer than
the ring has room for) from its row's ring, as one more (row, page) pair, and the
older ones from the quantized pages, whose pairs count only those; the merge takes
them all. Rounding the newest positions is what moves greedy output most (the model
attends them most), so this brings 8-bit KV's agreement with float KV near float16's
(docs/design/kv_tiers.md) for T float positions per running row.
"""

import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import base

from mlxd.runtime.kv_layout import DECODE_PAGE

from .kv_quant import GROUP, KVFormat

# mlx_lm's attention, taken before `install_hook` replaces the name anywhere
_MLX_LM_SDPA = base.scaled_dot_product_attention

FIRST_RINGS = 16   # rows the tail has rings for at first (it doubles as rows join)


def tail_ring(keep: int, slack: int) -> int:
    """Positions of one row's ring for a float tail of `keep` positions and verifies
    of up to `slack` drafts (--spec-max-draft). A verify writes every draft's
    position before knowing which it keeps: its first query needs the `keep`
    positions before its own, its last writes `slack` past it, and the rejected
    ones overwrite the ring's oldest. With this room every query of such a verify
    attends the float positions a decode step at its position would, and after
    the verify the kept tail is whole; a longer verify shortens the tail until the
    row has moved past what it wrote (PagedDecodeBatch.reached)."""
    return keep + slack


class PageArena:
    """The decode pages of every KV leaf. `keys[i]`/`values[i]` are leaf i's arena,
    head-major `[heads, (pages + 1) * page, dim]`: a head's page is `page` consecutive
    rows, and a run of consecutive pages is one slice per head, written from a row
    of a prefill cache (`[heads, positions, dim]`) without reordering.

    Starts at `pages` and, when out of pages, grows by a copy (doubling, at most to
    `max_pages` unless more is asked for; one array at a time, so the copy holds one
    old array beside the new arena): memory follows the most pages rows have held (it
    never shrinks). A page is held by one row or, shared (`hold`), by several: it goes
    back when its last holder frees it."""

    def __init__(self, num_leaves: int, heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
                 pages: int, page: int = DECODE_PAGE, max_pages: int = 0,
                 k_bits: int = 0, v_bits: int = 0, group: int = GROUP,
                 float_tail: int = 0, max_rows: int = 0, tail_slack: int = 8,
                 all_rings: bool = False):
        """`k_bits`/`v_bits`: pages hold keys/values in MLX affine groups of `group`
        (0: float). `float_tail` (with either quantized): each row's newest positions
        are attended from a float ring too (`tail`; `tail_ring(float_tail,
        tail_slack)` positions each), for up to `max_rows` rows (0: no limit), rings
        for all of them allocated at once with `all_rings`."""
        self.num_leaves, self.heads, self.page = num_leaves, heads, page
        self.k_dim, self.v_dim, self.dtype = k_dim, v_dim, dtype
        self.k_format = KVFormat.of(dtype, k_bits, k_dim, group)
        self.v_format = KVFormat.of(dtype, v_bits, v_dim, group)
        quantized = self.k_format.quantized or self.v_format.quantized
        # the float tail: a ring (`tail_ring` positions) per row, one page of `tail` each
        self.tail_keep = float_tail if quantized else 0
        rings = max_rows if max_rows and all_rings else min(max_rows or FIRST_RINGS, FIRST_RINGS)
        self.tail = PageArena(num_leaves, heads, k_dim, v_dim, dtype, rings,
                              tail_ring(float_tail, tail_slack),
                              max_pages=max_rows) if self.tail_keep else None
        self.max_pages = max_pages   # 0: no limit
        self.pages = 0
        # per leaf, the parts of its keys and of its values (kv_quant.py)
        self.keys: list[list[mx.array]] = [self.k_format.zeros((heads, 0), k_dim)
                                           for _ in range(num_leaves)]
        self.values: list[list[mx.array]] = [self.v_format.zeros((heads, 0), v_dim)
                                             for _ in range(num_leaves)]
        self._free: list[int] = []
        self._holders: dict[int, int] = {}   # page -> rows holding it
        self._grow(pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        tail = self.tail.nbytes if self.tail is not None else 0
        return tail + sum(a.nbytes for parts in self.keys + self.values for a in parts)

    def _grow(self, pages: int) -> None:
        """Room for `pages` pages (page 0 included beyond them)."""
        width = (pages + 1) * self.page

        def grown(a: mx.array) -> mx.array:
            if a.shape[1] == width:   # grown already by a growth that failed midway
                return a
            new = mx.zeros((self.heads, width, a.shape[2]), a.dtype)
            if a.shape[1]:
                new[:, :a.shape[1]] = a   # in place: the zeros' buffer is the result's
            mx.eval(new)
            return new

        # one array at a time: the old arena is let go of as it is copied (at most
        # one old array beside the new arena)
        for leaves in (self.keys, self.values):
            for parts in leaves:
                for j, a in enumerate(parts):
                    parts[j] = grown(a)
        self._give_back(range(self.pages + 1, pages + 1))
        self.pages = pages

    def allocate(self, n: int) -> list[int]:
        """The `n` lowest free page ids, ascending: mostly a contiguous run, which a
        join writes with one slice per run."""
        if n > len(self._free):
            need = self.pages + n - len(self._free)
            doubled = 2 * self.pages if not self.max_pages else min(2 * self.pages, self.max_pages)
            self._grow(max(doubled, need))
        pages = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        for p in pages:
            self._holders[p] = 1
        return pages

    def hold(self, page: int) -> None:
        """One more row holds `page` (a shared page)."""
        self._holders[page] += 1

    def free(self, pages) -> list[int]:
        """A row lets go of `pages`; returns those no row holds any more (free now)."""
        freed = []
        for p in pages:
            self._holders[p] -= 1
            if not self._holders[p]:
                del self._holders[p]
                freed.append(p)
        self._give_back(freed)
        return freed

    def _give_back(self, pages) -> None:
        # kept in descending order (a merge of two runs for timsort: linear)
        self._free.extend(pages)
        self._free.sort(reverse=True)

    def reset(self) -> None:
        """Every page free (no row holds any), whatever state a failed step left: a
        growth that failed midway leaves some arrays wider than the rest; they are
        made the arena's width again (their contents no longer matter)."""
        width = (self.pages + 1) * self.page

        def sized(a: mx.array) -> mx.array:
            return a if a.shape[1] == width else mx.zeros((self.heads, width, a.shape[2]),
                                                          a.dtype)

        self.keys = [[sized(a) for a in parts] for parts in self.keys]
        self.values = [[sized(a) for a in parts] for parts in self.values]
        self._holders = {}
        self._free = list(range(self.pages, 0, -1))
        if self.tail is not None:
            self.tail.reset()

    def check_integrity(self, held: list[list[int]]) -> None:
        """Every page is free or held, never both; a held page's count of holders is
        the number of times the tables name it."""
        named: dict[int, int] = {}
        for table in held:
            for p in table:
                named[p] = named.get(p, 0) + 1
        assert named == self._holders, "a page's holders miscounted"
        every = self._free + list(named)
        assert sorted(every) == list(range(1, self.pages + 1)), "pages lost or held twice"

    def write_run(self, leaf: int, first: int, keys: mx.array, values: mx.array) -> None:
        """Store positions `[heads, m, dim]` (m <= n x page) from the start of page
        `first` on, through pages first .. first + ceil(m / page) - 1: one slice per
        array, a copy of what is written."""
        start, m = first * self.page, keys.shape[1]
        for stored, part in self._parts(leaf, self._basis(keys, values)):
            stored[:, start:start + m] = part

    def write(self, leaf: int, heads: mx.array, rows: mx.array, keys: mx.array,
              values: mx.array, tail_at: tuple[mx.array, mx.array] | None = None) -> None:
        """Store `[n, dim]` keys/values at (head, row) pairs (MLX donates the
        buffer: the write costs the rows written), and at the (head, ring row) pairs
        `tail_at` of the float tail."""
        basis = self._basis(keys, values)
        for stored, part in self._parts(leaf, basis):
            stored[heads, rows] = part
        if tail_at is not None:
            self.tail.write(leaf, *tail_at, *basis)

    def write_tail(self, leaf: int, heads: mx.array, rows: mx.array, keys: mx.array,
                   values: mx.array) -> None:
        """Store `[n, dim]` keys/values at (head, ring row) pairs of the float tail."""
        self.tail.write(leaf, heads, rows, *self._basis(keys, values))

    def _basis(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values in the stored basis (the float tail holds them so)."""
        return self.k_format.basis(keys), self.v_format.basis(values)

    def _parts(self, leaf: int, basis: tuple[mx.array, mx.array]):
        """(stored array, its part of the new keys or values), for each part."""
        keys, values = basis
        return zip(self.keys[leaf] + self.values[leaf],
                   self.k_format.pack(keys) + self.v_format.pack(values), strict=True)


@dataclass(frozen=True)
class Pairs:
    """What one decode step's attention reads for one window size: the (row, page)
    pairs, as `gather_mm` indices per KV head, and which positions of each pair's
    page count for each query slot: `[n, 1, 1, L, page]` for a step of L query
    positions per row (`[n, 1, 1, page]` when L is 1)."""

    rows: mx.array    # [n] int32: the pair's row
    lhs: mx.array     # [n * heads] uint32: row * heads + head
    rhs: mx.array     # [n * heads] uint32: head * (arena pages + 1) + page
    mask: mx.array    # [n, 1, 1, L, page] bool ([n, 1, 1, page] when L == 1)
    window: int = 0   # the window the mask keeps (0: none); the slice path masks by it


def step_pairs(tables: list[list[int]], lengths: list[int], arena: "PageArena",
               window: int = 0, queries: list[int] | None = None,
               below: list[int] | None = None) -> Pairs:
    """The pairs of rows holding `lengths[i]` positions (the new ones included) in
    pages `tables[i]` of `arena`, row i's last `queries[i]` positions (default 1)
    being its queries. Each query counts the positions up to its own and, with a
    `window`, only the last `window` of them; with `below` (`[rows, L]`: per query
    slot), only those before `below[i][j]` (the float tail attends the rest): a row
    with none has no pairs. Query slots past a row's own (the forward is
    rectangular, L = max(queries)) count what its last query does, so no slot is
    fully masked."""
    page = arena.page
    queries = [1] * len(lengths) if queries is None else list(queries)
    slots = max(queries)
    rows, pages, starts, last_pos, ends = [], [], [], [], []
    # (a table entry 0 is a window of scratch positions only: no pair here)
    for r, (table, n, q) in enumerate(zip(tables, lengths, queries)):
        low = max(0, n - q - window + 1) if window else 0   # the first query's window start
        end = np.full(slots, n) if below is None else np.asarray(below[r])
        first, last = low // page, (min(n, int(end.max())) - 1) // page
        count = max(0, last - first + 1) if end.max() > low else 0
        rows.append(np.full(count, r))
        pages.append(np.asarray(table[first:first + count], dtype=np.int64))
        starts.append(np.arange(first, first + count) * page)
        last_pos.append(np.broadcast_to(query_positions(n, q, slots), (count, slots)))
        ends.append(np.broadcast_to(end, (count, slots)))
    pages = np.concatenate(pages)
    held = pages != 0   # (see above)
    positions = np.concatenate(starts)[held][:, None] + np.arange(page)   # [n, page]
    return _pairs(np.concatenate(rows)[held], pages[held], arena, positions,
                  np.concatenate(last_pos)[held], window, slots,
                  below=np.concatenate(ends)[held])


def tail_pairs(rings: list[int], lengths: list[int], lows, tail: "PageArena",
               window: int = 0, queries: list[int] | None = None) -> Pairs:
    """One pair per row: its float ring (a page of `tail`, ring position p at index p
    mod the ring's size) with the positions from `lows[i][j]` on counted for query
    slot j (`[rows, L]`), as `step_pairs` counts them for each query."""
    ring = tail.page
    queries = [1] * len(lengths) if queries is None else list(queries)
    slots = max(queries)
    ends = np.asarray(lengths)[:, None] - ring   # a ring's index j holds the position of
    held = ends + (np.arange(ring) - ends) % ring   # [rows, ring]: j's residue among the last `ring`
    at = np.stack([query_positions(n, q, slots) for n, q in zip(lengths, queries)])
    return _pairs(np.arange(len(rings)), np.asarray(rings), tail, held, at, window, slots,
                  low=np.asarray(lows))


def query_positions(n: int, q: int, slots: int) -> np.ndarray:
    """The positions of a row's `slots` query slots, its `q` queries the last of its
    `n` positions, padding slots at its last query."""
    return n - q + np.minimum(np.arange(slots), q - 1)


def _pairs(rows: np.ndarray, pages: np.ndarray, arena: "PageArena", positions: np.ndarray,
           at: np.ndarray, window: int, slots: int, low: np.ndarray | None = None,
           below: np.ndarray | None = None) -> Pairs:
    """The Pairs of (row, page) pairs whose pages hold `positions` `[n, page]`, the
    pairs' query slots at `at` `[n, L]`: each counts a position up to its own, in
    its window, from `low` and before `below` (`[n, L]`: per pair and slot)."""
    heads, stride = arena.heads, arena.pages + 1
    held, own = positions[:, None, :], at[:, :, None]   # [n, 1, page], [n, L, 1]
    mask = held <= own
    if window:
        mask &= held > own - window
    if low is not None:
        mask &= held >= low[:, :, None]
    if below is not None:
        mask &= held < below[:, :, None]
    mask = mask[:, None, None] if slots > 1 else mask[:, None]   # [n,1,1,L,page] | [n,1,1,page]
    per_head = np.arange(heads)
    return Pairs(mx.array(rows, mx.int32),
                 mx.array((rows[:, None] * heads + per_head).reshape(-1), mx.uint32),
                 mx.array((per_head * stride + pages[:, None]).reshape(-1), mx.uint32),
                 mx.array(mask), window)


def paged_attention(queries: mx.array, keys, values, pairs: Pairs, page: int, scale: float,
                    sinks: mx.array | None = None, k_format: KVFormat | None = None,
                    v_format: KVFormat | None = None,
                    tail: tuple[mx.array, mx.array, Pairs] | None = None,
                    more: tuple = ()) -> mx.array:
    """Attention of L query positions per row `[B, Hq, L, D]` over the pairs' pages of
    an arena (`keys`/`values` `[Hkv, (pages + 1) * page, D]`; as `[Hkv * (pages + 1),
    page, D]`, a free reshape, matrix `head * (pages + 1) + page` is one head's
    page): `[B, Hq, L, Dv]`. A KV head's query rows are its g = Hq / Hkv query heads
    x L positions, so each page is read once per row, whatever L is. With quantized
    formats, `keys`/`values` are their parts and the pages are multiplied as stored
    (`mx.gather_qmm`), never dequantized whole: the queries are rotated into the
    stored basis, and the output out of it (kv_quant.py). `tail`: a float tail's
    keys, values (in the stored basis) and pairs (`tail_pairs`), attended beside the
    pages and merged with them; `more`: (keys, values, pairs) of further stores in
    the same formats and page size (the pool beside the arena), merged alike."""
    b, hq, slots, d = queries.shape
    k_format = k_format or KVFormat(keys.dtype)
    v_format = v_format or KVFormat(values.dtype)
    k_parts = keys if k_format.quantized else [keys]
    heads = k_parts[0].shape[0]
    # [B, Hkv * g, L, D] head-major: (row, kv head) rows of g x L queries, a free reshape
    q = k_format.rotate(queries * scale).astype(k_format.dtype).reshape(b * heads, hq // heads * slots, d)
    parts = []
    for ks, vs, ps in ((keys, values, pairs), *more):
        if ps.rows.shape[0]:
            parts.append(_attend_pairs(q, ks if k_format.quantized else [ks],
                                       vs if v_format.quantized else [vs],
                                       k_format, v_format, ps, page))
    if tail is not None:
        tk, tv, ring = tail
        parts.append(_attend_pairs(q, [tk], [tv], KVFormat(tk.dtype), KVFormat(tv.dtype),
                                   ring, ring.mask.shape[-1]))
    out, lse, rows = (mx.concatenate(p) if len(parts) > 1 else p[0] for p in zip(*parts))
    merged = _merge_rows(out, lse, rows, b, sinks)   # linear: rotated back after it
    dv = merged.shape[-1]
    return v_format.rotate(merged, back=True).reshape(b, hq, slots, dv).astype(queries.dtype)


def _attend_pairs(q: mx.array, k_parts: list[mx.array], v_parts: list[mx.array],
                  k_format: KVFormat, v_format: KVFormat, pairs: Pairs,
                  page: int) -> tuple[mx.array, mx.array, mx.array]:
    """Each pair's attention of its row's queries `q` `[B * Hkv, g * L, D]` over its
    page alone: the output `[n, Hkv, g, L, Dv]` (normalized within the page), its
    log-sum-exp `[n, Hkv, g, L]` (-inf where no position counts), the pairs' rows."""
    n = pairs.rows.shape[0]
    heads = pairs.lhs.shape[0] // n
    slots = pairs.mask.shape[-2] if pairs.mask.ndim == 5 else 1
    g = q.shape[1] // slots
    dv = v_parts[0].shape[-1] * (32 // v_format.bits if v_format.quantized else 1)
    scores = _page_matmul(q, k_parts, k_format, page, pairs.lhs, pairs.rhs,
                          transpose=True).astype(mx.float32)
    mask = pairs.mask.reshape(n, 1, 1, -1, page)
    scores = mx.where(mask, scores.reshape(n, heads, g, slots, page), -mx.inf)
    peak = mx.max(scores, axis=-1, keepdims=True)
    peak = mx.where(mx.isinf(peak), 0.0, peak)   # a page with no position counted
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1)
    lse = peak.squeeze(-1) + mx.log(mx.maximum(total, 1e-30))
    lse = mx.where(total > 0, lse, -mx.inf)
    out = _page_matmul(weights.astype(v_format.dtype).reshape(n * heads, g * slots, page),
                       v_parts, v_format, page, mx.arange(n * heads, dtype=mx.uint32),
                       pairs.rhs, transpose=False)
    out = (out.astype(mx.float32).reshape(n, heads, g, slots, dv)
           / mx.maximum(total, 1e-30)[..., None])
    return out, lse, pairs.rows


def _page_matmul(x: mx.array, parts: list[mx.array], fmt: KVFormat, page: int,
                 lhs: mx.array, rhs: mx.array, transpose: bool) -> mx.array:
    """`x[lhs] @ page[rhs]` (`.T` with `transpose`) over an arena's pages, stored as
    `parts` in `fmt`."""
    pages = [a.reshape(-1, page, a.shape[-1]) for a in parts]
    if not fmt.quantized:
        w = pages[0].swapaxes(-1, -2) if transpose else pages[0]
        return mx.gather_mm(x, w, lhs, rhs)
    return mx.gather_qmm(x, *pages, lhs_indices=lhs, rhs_indices=rhs, transpose=transpose,
                         group_size=fmt.group, bits=fmt.bits)


def _merge_rows(out: mx.array, lse: mx.array, rows: mx.array, b: int,
                sinks: mx.array | None) -> mx.array:
    """Each row's pairs `[n, Hkv, g, L, Dv]` merged by their log-sum-exp `[n, Hkv, g,
    L]` (and the sinks' logits, one per query head, if any): `[B, Hkv, g, L, Dv]`."""
    n, heads, g, slots, dv = out.shape
    row_peak = mx.full((b, heads, g, slots), -mx.inf).at[rows].maximum(lse)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, heads, g, 1)
        row_peak = mx.maximum(row_peak, sink)
    w = mx.exp(lse - row_peak[rows])
    norm = mx.zeros((b, heads, g, slots)).at[rows].add(w)
    if sinks is not None:
        norm = norm + mx.exp(sink - row_peak)
    merged = mx.zeros((b, heads, g, slots, dv)).at[rows].add(w[..., None] * out)
    return merged / norm[..., None]


def span_mask(count: int, slots: int, window: int = 0) -> mx.array | str | None:
    """The slice path's mask for `slots` queries, the last at the last of `count`
    keys: None for one query (the slice is what it reads), mx.fast's lower-right
    "causal" without a window, else `[slots, count]` bool (True: counted)."""
    if slots == 1:
        return None
    if not window:
        return "causal"
    at = mx.arange(count - slots, count)[:, None]   # each query's own key
    keys = mx.arange(count)[None, :]
    return (keys <= at) & (keys > at - window)


@dataclass(frozen=True)
class Writes:
    """Where a forward's new positions go, in the (row, head, position) order of
    the new KV flattened (`[B * heads * L, dim]`): `heads` of each; the pool's
    (index into the flat rows, head, pool row), None for no position there; the
    arena's (head, arena row, index into the flat rows or None: all of them)."""

    heads: mx.array
    pool: tuple[mx.array, mx.array, mx.array] | None
    arena: tuple[mx.array, mx.array, mx.array | None] | None

    @classmethod
    def of(cls, pool_at: np.ndarray, arena_at: np.ndarray, heads: int) -> "Writes":
        """From each row's `[rows, L]` pool rows (0: not in the pool) and arena rows."""
        h = np.tile(np.repeat(np.arange(heads), pool_at.shape[1]), len(pool_at))
        pool_rows, arena_rows = per_head_rows(pool_at, heads), per_head_rows(arena_at, heads)
        in_pool = pool_rows > 0
        heads_all = mx.array(h, mx.int32)
        if not in_pool.any():
            return cls(heads_all, None, (heads_all, mx.array(arena_rows, mx.int32), None))
        at = np.flatnonzero(in_pool)
        pool = (mx.array(at, mx.int32), mx.array(h[at], mx.int32),
                mx.array(pool_rows[at], mx.int32))
        if in_pool.all():
            return cls(heads_all, pool, None)
        rest = np.flatnonzero(~in_pool)
        return cls(heads_all, pool, (mx.array(h[rest], mx.int32),
                                     mx.array(arena_rows[rest], mx.int32),
                                     mx.array(rest, mx.int32)))


def per_head_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Each row's `[rows, L]` store rows repeated for every head, in (row, head,
    position) order: the order update_and_fetch flattens the new KV in."""
    return np.repeat(rows[:, None, :], heads, axis=1).reshape(-1)


class PagedLayerCache:
    """One KV leaf's cache for one decode forward, as the model sees it.

    A forward gives each row L consecutive query positions (L = 1 for a decode step;
    more for a verify forward). `writes` (a `Writes`, or the arena's (head, arena
    row) of every position, each `[B * heads * L]`, in (row, head, position) order:
    the order of `keys.reshape(-1, dim)` for the `[B, heads, L, dim]` the model
    writes) says where the new positions go; `pairs` are the arena's (row, page)
    pairs to read, `pool_pairs` the pool's (either None: no row reads that store; the
    decode batch reads the pool only). `span` (one row whose positions are one
    run of rows of one store) is (first row, positions, in the pool): from the
    window start of the row's first query (0 without a window) to its last query,
    included."""

    def __init__(self, arena: PageArena, leaf: int, offset: mx.array, writes, pairs: Pairs,
                 span: tuple | None = None,
                 tail: tuple[tuple[mx.array, mx.array], Pairs] | None = None,
                 pool=None, pool_pairs: Pairs | None = None):
        self.arena, self.leaf, self.pairs = arena, leaf, pairs
        self.pool, self.pool_pairs = pool, pool_pairs
        if writes is not None and not isinstance(writes, Writes):   # the arena's (head, row)
            writes = Writes(writes[0], None, (writes[0], writes[1], None))
        self.writes = writes
        # attended as a slice (no gather, no merge)
        self.span = span if span is None or len(span) == 3 else (*span, False)
        self.offset = offset            # [B]: each row's first query's position (RoPE)
        # the float tail's (head, ring row) of each new position, and its pairs
        self.tail = tail
        self.newest: tuple[mx.array, mx.array] | None = None
        self.attended = False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new positions `[B, heads, L, dim]` where `writes` says (and into
        the rows' float tails)."""
        self.newest = (keys, values)
        k, v = keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1])
        w = self.writes
        if w is not None and w.arena is not None:
            heads, rows, index = w.arena
            picked = (k, v) if index is None else (k[index], v[index])
            self.arena.write(self.leaf, heads, rows, *picked)
        if w is not None and w.pool is not None:
            index, heads, rows = w.pool
            self.pool.write_at(self.leaf, heads, rows, k[index], v[index])
        if self.tail is not None:
            self.arena.write_tail(self.leaf, *self.tail[0], k, v)
        return keys, values

    def make_mask(self, *args, **kwargs):
        return None

    # mlx_lm's pipeline stages tie their send to the last layer's cache
    # (`cache[-1].keys = mx.depends(cache[-1].keys, h)`): the newest keys stand for it
    @property
    def keys(self) -> mx.array | None:
        return self.newest[0] if self.newest else None

    @keys.setter
    def keys(self, keys: mx.array) -> None:
        if self.newest:
            self.newest = (keys, self.newest[1])

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        self.attended = True
        arena = self.arena
        quantized = arena.k_format.quantized or arena.v_format.quantized
        if self.span is not None and not quantized:   # quantized pages: always by pairs
            start, n, in_pool = self.span
            store = self.pool if in_pool else arena
            k = store.keys[self.leaf][0][None, :, start:start + n]
            v = store.values[self.leaf][0][None, :, start:start + n]
            window = (self.pairs or self.pool_pairs).window
            mask = span_mask(n, queries.shape[2], window)
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask,
                                                        sinks=sinks)
        tail = None
        if self.tail is not None:
            tail = (arena.tail.keys[self.leaf][0], arena.tail.values[self.leaf][0], self.tail[1])
        sources = [(self._stored(store.keys, arena.k_format),
                    self._stored(store.values, arena.v_format), pairs)
                   for store, pairs in ((arena, self.pairs), (self.pool, self.pool_pairs))
                   if pairs is not None]
        (keys, values, pairs), *more = sources
        return paged_attention(queries, keys, values, pairs, arena.page, scale, sinks,
                               arena.k_format, arena.v_format, tail, tuple(more))

    def _stored(self, store: list, fmt: KVFormat):
        """This leaf's parts of a store: the list (quantized), or the one array."""
        return store[self.leaf] if fmt.quantized else store[self.leaf][0]


# ---- the hook -------------------------------------------------------------

def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, PagedLayerCache):
        return cache.attend(queries, scale, sinks)
    return _MLX_LM_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_hook(model) -> None:
    """Route the attention of the model's modules through `scaled_dot_product_attention`
    above (where they call mlx_lm's base function by that name)."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    names = {type(m).__module__ for m in modules} | {"mlx_lm.models.base"}
    for name in names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is _MLX_LM_SDPA:
            module.scaled_dot_product_attention = scaled_dot_product_attention
