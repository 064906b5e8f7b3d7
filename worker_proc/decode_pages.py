"""Decode without padding: the running rows' KV in pages, attended where it lies.

Each KV leaf of the model has a page arena: keys and values `[heads, (pages + 1) *
P, dim]`, head-major (a head's page is P consecutive rows; P = kv_layout's
DECODE_PAGE), page 0 never handed out. A running row owns a list of pages (its page
table) holding its positions in order; the page ids are the same in every leaf. A
decode step writes each row's new position into its last page (a scatter of one
position per row and head), then attends, per (row, page) pair, the row's queries
to that page in place with `mx.gather_mm` (scores, then weights x values), and
merges each row's pairs by their softmax's log-sum-exp; a lone row whose pages are
one run is attended as one slice instead. A verify forward (speculative decoding)
gives each row several consecutive query positions at once: all are written first,
then each query attends causally (the positions up to its own), every page read
once per row for all of them. A step's cost follows the pages the rows
hold, not the longest row; a row joins by writing its own pages (one slice per run
of consecutive pages) and leaves by giving them back; nothing else moves. A full
page another running row holds for the same pool slots (a cached prefix both start
from) is held by both instead of written twice (shared_pages, paged_batch). The
arena starts small and grows as rows need pages, up to the memory split's decode
budget.

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
                 k_bits: int = 0, v_bits: int = 0, group: int = GROUP):
        """`k_bits`/`v_bits`: pages hold keys/values in MLX affine groups of `group`
        (0: float)."""
        self.num_leaves, self.heads, self.page = num_leaves, heads, page
        self.k_dim, self.v_dim, self.dtype = k_dim, v_dim, dtype
        self.k_format = KVFormat.of(dtype, k_bits, k_dim, group)
        self.v_format = KVFormat.of(dtype, v_bits, v_dim, group)
        self.max_pages = max_pages   # 0: no limit
        self.pages = 0
        # per leaf, the parts of its keys and of its values (kv_quant.py)
        self.keys: list[list[mx.array]] = [self.k_format.zeros((heads, 0), k_dim)
                                           for _ in range(num_leaves)]
        self.values: list[list[mx.array]] = [self.v_format.zeros((heads, 0), v_dim)
                                             for _ in range(num_leaves)]
        self._free: list[int] = []
        self._holders: dict[int, int] = {}   # page -> rows holding it
        self._grow(max(1, pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for parts in self.keys + self.values for a in parts)

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
        for stored, part in self._parts(leaf, keys, values):
            stored[:, start:start + m] = part

    def write(self, leaf: int, heads: mx.array, rows: mx.array, keys: mx.array,
              values: mx.array) -> None:
        """Store `[n, dim]` keys/values at (head, row) pairs (MLX donates the
        buffer: the write costs the rows written)."""
        for stored, part in self._parts(leaf, keys, values):
            stored[heads, rows] = part

    def _parts(self, leaf: int, keys: mx.array, values: mx.array):
        """(stored array, its part of the new keys or values), for each part."""
        return zip(self.keys[leaf] + self.values[leaf],
                   self.k_format.encode(keys) + self.v_format.encode(values), strict=True)


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
               window: int = 0, queries: list[int] | None = None) -> Pairs:
    """The pairs of rows holding `lengths[i]` positions (the new ones included) in
    pages `tables[i]` of `arena`, row i's last `queries[i]` positions (default 1)
    being its queries. Each query counts the positions up to its own and, with a
    `window`, only the last `window` of them. Query slots past a row's own (the
    forward is rectangular, L = max(queries)) count what its last query does, so no
    slot is fully masked."""
    heads, page = arena.heads, arena.page
    queries = [1] * len(lengths) if queries is None else list(queries)
    slots = max(queries)
    rows, pages, starts, last_pos = [], [], [], []
    for r, (table, n, q) in enumerate(zip(tables, lengths, queries)):
        low = max(0, n - q - window + 1) if window else 0   # the first query's window start
        first, last = low // page, (n - 1) // page
        count = last - first + 1
        rows.append(np.full(count, r))
        pages.append(np.asarray(table[first:last + 1]))
        starts.append(np.arange(first, last + 1) * page)
        # each slot's position, padding slots at the row's last query
        own = n - q + np.minimum(np.arange(slots), q - 1)
        last_pos.append(np.broadcast_to(own, (count, slots)))
    rows_np, pages_np = np.concatenate(rows), np.concatenate(pages)
    stride = arena.pages + 1
    positions = (np.concatenate(starts)[:, None] + np.arange(page))[:, None, :]   # [n, 1, page]
    at = np.concatenate(last_pos)[:, :, None]                                      # [n, L, 1]
    mask = positions <= at
    if window:
        mask &= positions > at - window
    mask = mask[:, None, None] if slots > 1 else mask[:, None]   # [n,1,1,L,page] | [n,1,1,page]
    per_head = np.arange(heads)
    return Pairs(mx.array(rows_np, mx.int32),
                 mx.array((rows_np[:, None] * heads + per_head).reshape(-1), mx.uint32),
                 mx.array((per_head * stride + pages_np[:, None]).reshape(-1), mx.uint32),
                 mx.array(mask), window)


def paged_attention(queries: mx.array, keys, values, pairs: Pairs, page: int, scale: float,
                    sinks: mx.array | None = None, k_format: KVFormat | None = None,
                    v_format: KVFormat | None = None) -> mx.array:
    """Attention of L query positions per row `[B, Hq, L, D]` over the pairs' pages of
    an arena (`keys`/`values` `[Hkv, (pages + 1) * page, D]`; as `[Hkv * (pages + 1),
    page, D]`, a free reshape, matrix `head * (pages + 1) + page` is one head's
    page): `[B, Hq, L, Dv]`. A KV head's query rows are its g = Hq / Hkv query heads
    x L positions, so each page is read once per row, whatever L is. With quantized
    formats, `keys`/`values` are their parts and the pages are multiplied as stored
    (`mx.gather_qmm`), never dequantized whole: the queries are rotated into the
    stored basis, and the output out of it (kv_quant.py)."""
    b, hq, slots, d = queries.shape
    heads = pairs.lhs.shape[0] // pairs.rows.shape[0]
    g, n = hq // heads, pairs.rows.shape[0]
    k_format = k_format or KVFormat(keys.dtype)
    v_format = v_format or KVFormat(values.dtype)
    k_parts = keys if k_format.quantized else [keys]
    v_parts = values if v_format.quantized else [values]
    dv = v_parts[0].shape[-1] * (32 // v_format.bits if v_format.quantized else 1)
    # [B, Hkv * g, L, D] head-major: (row, kv head) rows of g x L queries, a free reshape
    q = k_format.rotate(queries * scale).astype(k_format.dtype).reshape(b * heads, g * slots, d)
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
    merged = _merge_rows(out, lse, pairs.rows, b, sinks)   # linear: rotated back after it
    return v_format.rotate(merged, back=True).reshape(b, hq, slots, dv).astype(queries.dtype)


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


class PagedLayerCache:
    """One KV leaf's cache for one decode forward, as the model sees it.

    A forward gives each row L consecutive query positions (L = 1 for a decode step;
    more for a verify forward). `write_at` is (head, arena row), each `[B * heads *
    L]`, in (row, head, position) order: the order of `keys.reshape(-1, dim)` for the
    `[B, heads, L, dim]` the model writes. `span` (one row whose positions are one run
    of arena rows) is (first arena row, positions): from the window start of the
    row's first query (0 without a window) to its last query, included."""

    def __init__(self, arena: PageArena, leaf: int, offset: mx.array,
                 write_at: tuple[mx.array, mx.array], pairs: Pairs,
                 span: tuple[int, int] | None = None):
        self.arena, self.leaf, self.pairs = arena, leaf, pairs
        # attended as a slice (no gather, no merge)
        self.span = span
        self.offset = offset            # [B]: each row's first query's position (RoPE)
        self.write_at = write_at        # ([B * heads * L] head, [B * heads * L] arena row)
        self.newest: tuple[mx.array, mx.array] | None = None
        self.attended = False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new positions `[B, heads, L, dim]` into the rows' pages."""
        self.newest = (keys, values)
        self.arena.write(self.leaf, *self.write_at,
                         keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1]))
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
            start, n = self.span
            k = arena.keys[self.leaf][0][None, :, start:start + n]
            v = arena.values[self.leaf][0][None, :, start:start + n]
            mask = span_mask(n, queries.shape[2], self.pairs.window)
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask,
                                                        sinks=sinks)
        keys, values = arena.keys[self.leaf], arena.values[self.leaf]
        return paged_attention(queries, keys if arena.k_format.quantized else keys[0],
                               values if arena.v_format.quantized else values[0],
                               self.pairs, arena.page, scale, sinks,
                               arena.k_format, arena.v_format)


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
