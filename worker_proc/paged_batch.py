"""The running requests' decode state in pages (decode_pages): one page table per
row, the KV in the page arena, recurrent states (hybrid models) one row each.

A joining row writes its KV into fresh pages, except for the full pages another
running row already holds with the same pool slots (shared_pages: a shared prefix is
held once); a leaving row lets go of its pages; neither touches another row's KV.
Each forward builds the caches the model sees (a `PagedLayerCache` per KV leaf, the
persistent state caches) from the tables: the new position's arena rows and the
(row, page) pairs each window size reads.
"""

import mlx.core as mx
import numpy as np

from . import batch_cache
from .batch_cache import CacheLayout
from .decode import JoinGroup
from .decode_pages import (
    PageArena, PagedLayerCache, query_positions, step_pairs, tail_pairs,
)
from .sampling import RowState
from .shared_pages import SharedPages


class PagedDecodeBatch:
    """Rows in order; `row_rids` never holds a released row (release is free). With
    `share`, joining rows' full pages are shared by their pool slots (not for a
    window pool: a windowed layer's prefix positions beyond the window are not
    loaded, so two rows' pages with the same slots may differ there)."""

    def __init__(self, layout: CacheLayout, arena: PageArena, share: bool = True):
        self.layout, self.arena = layout, arena
        self.shared = SharedPages(arena.page) if share else None
        self.row_rids: list[int] = []
        self.rows: list[RowState] = []
        self.tables: list[list[int]] = []   # per row: its pages, in position order
        self.lengths: list[int] = []        # per row: positions held (the newest input's excluded)
        # with a float tail (arena.tail), per row: its ring, and one past the newest
        # position it was written (a verify's rejected drafts included)
        self.rings: list[int] = []
        self.reached: list[int] = []
        self.tokens: mx.array | None = None  # [rows] next input token of each row
        # per state leaf, in the layout's order: [rows, ...] arrays (hybrid models)
        self.states: list[list[mx.array]] = []
        self._leaves: list[PagedLayerCache] = []   # the last forward's KV leaves
        self._held: list[int] = []   # the rows' lengths before the last forward
        self._positions: mx.array | None = None   # a verify's real positions of [B * L]
        self._verified = None   # a verify's (inputs, states before it), with states

    @property
    def page(self) -> int:
        return self.arena.page

    @property
    def rids(self) -> list[int]:
        return list(self.row_rids)

    def __len__(self) -> int:
        return len(self.row_rids)

    @property
    def cache_tokens(self) -> int:
        """Tokens the rows' pages span (kv_layout's rule budgets at least this)."""
        return sum(len(t) for t in self.tables) * self.arena.page

    # ---- rows joining and leaving ------------------------------------------

    def add(self, groups: list[JoinGroup]) -> None:
        """Write every joining row's KV into pages of its own; append the rows."""
        tokens = [] if self.tokens is None else [self.tokens]
        for group in groups:
            self._write_group(group)
            tokens.append(group.first_tokens)
            self.row_rids += group.rids
            self.rows += group.rows
        self.tokens = mx.concatenate(tokens)

    def _write_group(self, group: JoinGroup) -> None:
        kv = batch_cache.kv_leaves(self.layout, group.caches)
        states = batch_cache.state_leaves(self.layout, group.caches)
        lefts, end = batch_cache.row_extents(kv[0])
        lengths = [end - left for left in lefts]
        slots = group.slots or [None] * len(lengths)
        tables, fresh = [], []
        for n, row_slots in zip(lengths, slots):
            table, todo = self._table(n, row_slots)
            tables.append(table)
            fresh.append(todo)
        if end:
            self._write_pages(kv, tables, fresh, lefts, end)
        if self.arena.tail is not None:
            rings = self.arena.tail.allocate(len(lengths))
            self._write_rings(kv, rings, lengths, lefts)
            self.rings += rings
            self.reached += lengths
        self.tables += tables
        self.lengths += lengths
        for i, leaf in enumerate(states):
            arrays = batch_cache.state_arrays(leaf)
            if len(self.states) <= i:
                self.states.append(arrays)
            else:
                self.states[i] = [mx.concatenate([a, b]) for a, b in zip(self.states[i], arrays)]

    def _table(self, n: int, slots: list[int] | None) -> tuple[list[int], list[int]]:
        """The pages of a row joining with `n` positions held at pool `slots`: its
        full pages shared where a running row holds them already, fresh ones for the
        rest (listed for sharing when full). Returns (table, indices to write)."""
        page = self.arena.page
        table = [0] * -(-n // page)
        assert slots is None or len(slots) == n, "a joining row's slots are its positions'"
        full = n // page if slots is not None and self.shared is not None else 0
        for j in range(full):
            hit = self.shared.find(slots[j * page:(j + 1) * page])
            if hit:
                self.arena.hold(hit)
                table[j] = hit
        todo = [j for j, p in enumerate(table) if not p]
        for j, p in zip(todo, self.arena.allocate(len(todo))):
            table[j] = p
            if j < full:
                self.shared.add(p, slots[j * page:(j + 1) * page])
        return table, todo

    def _write_pages(self, kv: list, tables: list[list[int]], fresh: list[list[int]],
                     lefts: list[int], end: int) -> None:
        """Every row's positions of every KV leaf into its fresh pages: per run of
        consecutive page ids, one slice of the prefill cache into one slice of the
        arena (columns past the row's end are padding, masked out)."""
        page = self.arena.page
        for r, (table, todo, left) in enumerate(zip(tables, fresh, lefts)):
            for j, first, n in _runs(table, todo):
                start = left + j * page
                stop = min(start + n * page, end)
                for leaf, cache in enumerate(kv):
                    k, v = batch_cache.row_columns(cache, r, start, stop)   # [heads, m, dim]
                    self.arena.write_run(leaf, first, k, v)

    def _write_rings(self, kv: list, rings: list[int], lengths: list[int],
                     lefts: list[int]) -> None:
        """Every joining row's newest positions (as many as its ring holds) of every
        KV leaf into its ring of the float tail, position p at index p mod the ring."""
        tail, heads = self.arena.tail, self.arena.heads
        for r, (ring, n, left) in enumerate(zip(rings, lengths, lefts)):
            first = max(0, n - tail.page)
            if first == n:
                continue
            at = ring * tail.page + np.arange(first, n) % tail.page
            head_ids = mx.array(np.repeat(np.arange(heads), n - first), mx.int32)
            ring_rows = mx.array(np.tile(at, heads), mx.int32)
            for leaf, cache in enumerate(kv):
                k, v = batch_cache.row_columns(cache, r, left + first, left + n)
                self.arena.write_tail(leaf, head_ids, ring_rows, k.reshape(-1, k.shape[-1]),
                                      v.reshape(-1, v.shape[-1]))

    def check_integrity(self) -> None:
        """The arena's pages are those the tables hold; each row holds a ring of the
        float tail of its own."""
        self.arena.check_integrity(self.tables)
        if self.arena.tail is not None:
            self.arena.tail.check_integrity([[r] for r in self.rings])

    def slots_written(self, slots) -> None:
        """The pool's `slots` are being written (a prefill's new tokens, a decode's
        inputs): pages shared under them are no longer found by them."""
        if self.shared is not None:
            self.shared.written(slots)

    def _let_go(self, table: list[int]) -> None:
        freed = self.arena.free(table)
        if self.shared is not None:
            self.shared.forget(freed)

    def remove(self, rids: set[int]) -> None:
        """Drop released rows: their pages go back, the rest stay where they are."""
        if not rids.intersection(self.row_rids):
            return
        keep = [i for i, rid in enumerate(self.row_rids) if rid not in rids]
        if not keep:
            self.clear()
            return
        for i, rid in enumerate(self.row_rids):
            if rid in rids:
                self._let_go(self.tables[i])
                if self.rings:
                    self.arena.tail.free([self.rings[i]])
        self.row_rids = [self.row_rids[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]
        self.tables = [self.tables[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if self.rings:
            self.rings = [self.rings[i] for i in keep]
            self.reached = [self.reached[i] for i in keep]
        index = mx.array(keep)
        self.tokens = self.tokens[index]
        self.states = [[a[index] for a in leaf] for leaf in self.states]

    def clear(self) -> None:
        """No rows: every page free and nothing listed for sharing (also after a step
        that failed midway through a join or a growth, whose pages no table names)."""
        self.arena.reset()
        if self.shared is not None:
            self.shared = SharedPages(self.arena.page)
        self.row_rids, self.rows, self.tables, self.lengths = [], [], [], []
        self.rings, self.reached = [], []
        self.tokens, self.states, self._leaves = None, [], []
        self._verified = None

    # ---- decode ----------------------------------------------------------

    def forward(self, model, drafts: list[list[int]] | None = None) -> mx.array:
        """Logits `[rows, V]` for the next token of every row (lazy). Each row's
        input goes at its next position, in a new page when the last is full.

        With `drafts` (one list per row, maybe empty), row i's input is its next
        token then `drafts[i]`, at consecutive positions, all attended causally in
        one forward (a verify): logits `[sum(1 + len(d)), V]`, each row's positions in
        turn. The rows' lengths count every position until `accept` says how many
        of them hold KV to keep. Recurrent states see only each row's own positions
        (the padding of shorter drafts is masked out of them), and a verify's
        states count all of them: `replay` gives the states of the kept ones."""
        page = self.arena.page
        queries = [1 + len(d) for d in drafts] if drafts else [1] * len(self.tables)
        width = max(queries)
        for table, n, q in zip(self.tables, self.lengths, queries):
            short = -(-(n + q) // page) - len(table)
            if short > 0:
                table += self.arena.allocate(short)
        inputs = self.tokens[:, None]
        if width > 1:
            padded = [d + [0] * (width - 1 - len(d)) for d in drafts]
            inputs = mx.concatenate([inputs, mx.array(padded, dtype=inputs.dtype)], axis=1)
        self._verified = (inputs, self.states) if width > 1 and self.states else None
        logits = self._run(model, inputs, queries)
        if width == 1:
            self._positions = None
            return logits[:, -1, :]
        self._positions = mx.array([i * width + j for i, q in enumerate(queries)
                                    for j in range(q)])
        return logits.reshape(-1, logits.shape[-1])[self._positions]

    def _run(self, model, inputs: mx.array, queries: list[int]) -> mx.array:
        """The model over `inputs` `[rows, width]`, row i's first `queries[i]` of them
        at its next positions (the rest padding: written to page 0, masked out of
        the attention and of recurrent states); the rows' lengths advance by their
        queries. Logits `[rows, width, V]` (lazy)."""
        page, heads = self.arena.page, self.arena.heads
        width = inputs.shape[1]
        rows = np.zeros((len(self.tables), width), dtype=np.int64)   # padding: page 0
        for i, (table, n, q) in enumerate(zip(self.tables, self.lengths, queries)):
            at = n + np.arange(q)
            rows[i, :q] = np.asarray(table)[at // page] * page + at % page
        # (row, head, position) order, as update_and_fetch flattens the new KV
        write_at = (mx.array(np.tile(np.repeat(np.arange(heads), width), len(rows)), mx.int32),
                    _per_head(rows, heads))
        offset = mx.array(np.array(self.lengths), mx.int32)
        after = [n + q for n, q in zip(self.lengths, queries)]
        several = queries if width > 1 else None
        ring_rows, lows = self._tail_step(after, queries, width)
        pairs = {w: step_pairs(self.tables, after, self.arena, w, several, lows)
                 for w in set(self.layout.windows)}
        spans = {w: self._span(after, w, queries[0]) for w in pairs}
        tails = {}
        if lows is not None:
            tail_at = (write_at[0], ring_rows)   # the heads as write_at's
            tails = {w: (tail_at, tail_pairs(self.rings, after, lows, self.arena.tail, w,
                                             several)) for w in pairs}
        self._leaves = [PagedLayerCache(self.arena, i, offset, write_at, pairs[w], spans[w],
                                        tails.get(w))
                        for i, w in enumerate(self.layout.windows)]
        caches, state_caches = batch_cache.assemble(self.layout, self._leaves, self.states,
                                                    queries if width > 1 else None)
        logits = model(inputs, cache=caches)
        # the states the forward left (lazy)
        self.states = [batch_cache.state_arrays(c) for c in state_caches]
        self._held = list(self.lengths)
        self.lengths = after
        return logits

    def _tail_step(self, after: list[int], queries: list[int], width: int):
        """With a float tail: the ring row of each new position `[B * heads * L]` (in
        write_at's order; the positions a ring cannot hold, and padding, at ring 0),
        and for each query slot `[rows, L]` the first position the tail attends: the
        `keep` up to the query's own, as a decode step at its position would (a
        verify's queries see what one-at-a-time decoding would), less any its ring
        lost to positions written past them (rejected drafts of a longer verify than
        the ring has room for). (None, None) without one."""
        tail = self.arena.tail
        if tail is None:
            return None, None
        ring, keep = tail.page, self.arena.tail_keep
        at = np.zeros((len(after), width), dtype=np.int64)   # padding: ring 0
        lows = np.zeros((len(after), width), dtype=np.int64)
        for i, (r, n, q) in enumerate(zip(self.rings, after, queries)):
            new = np.arange(n - q, n)
            kept = new >= n - ring
            at[i, :q][kept] = r * ring + new[kept] % ring
            self.reached[i] = max(self.reached[i], n)
            own = query_positions(n, q, width)
            lows[i] = np.maximum(np.maximum(own + 1 - keep, self.reached[i] - ring), 0)
        return _per_head(at, self.arena.heads), lows

    def needs_replay(self, kept: list[int], drafts: list[list[int]]) -> bool:
        """After a verify: whether a row keeps fewer positions than it verified while
        the rows have recurrent states (which then counted positions it drops)."""
        return self._verified is not None and any(
            k < 1 + len(d) for k, d in zip(kept, drafts))

    def replay(self, model, kept: list[int]) -> None:
        """After a verify, before `accept`: every row's recurrent states after its
        first `kept[i]` positions, recomputed from the states before the verify
        (the verify's count every position it checked). The forward writes those
        positions' KV again, as the verify did; its logits are never computed."""
        inputs, before = self._verified
        self.lengths, self.states = self._held, before
        self._run(model, inputs[:, :max(kept)], kept)
        self._verified = None

    def accept(self, kept: list[int], tokens: mx.array, held: list[int] | None = None) -> None:
        """After a verify: row i keeps the KV of its first `kept[i]` new positions
        (its input and the accepted draft tokens) and its next input is `tokens[i]`;
        pages past what it holds now go back. `held`: the rows' lengths before the
        positions counted (default: before the last forward)."""
        page = self.arena.page
        for i, (n, k) in enumerate(zip(self._held if held is None else held, kept)):
            self.lengths[i] = n + k
            table = self.tables[i]
            spare = len(table) - -(-(n + k) // page)
            if spare > 0:   # fresh pages of this step's rejected positions
                self._let_go(table[-spare:])
                del table[-spare:]
        self.tokens = tokens

    def _span(self, lengths: list[int], window: int, queries: int = 1) -> tuple[int, int] | None:
        """A lone row whose pages are one run: the positions its `queries` newest
        positions attend (from the window start of the first, for a windowed layer)
        as (first arena row, count), attended as one slice."""
        if len(self.tables) != 1 or len(_runs(self.tables[0])) != 1:
            return None
        n = lengths[0]
        low = max(0, n - (queries - 1) - window) if window else 0
        return self.tables[0][0] * self.arena.page + low, n - low

    def newest_kv(self) -> list[tuple[mx.array, mx.array]]:
        """Per KV leaf, keys/values `[positions, heads, dim]` the last forward wrote:
        one per row, or after a verify every row's positions in turn."""
        if self._positions is None:
            return [(c.newest[0][:, :, -1, :], c.newest[1][:, :, -1, :]) for c in self._leaves]
        return [(_real_positions(c.newest[0], self._positions),
                 _real_positions(c.newest[1], self._positions))
                for c in self._leaves]

    def hook_reached(self) -> bool:
        """The last forward's attention went through every KV leaf's `attend`."""
        return all(c.attended for c in self._leaves)

    def arrays(self) -> list[mx.array]:
        """What a step evaluates to complete the batch's writes."""
        tail = self.arena.tail
        rings = [tail.keys, tail.values] if tail is not None else []
        return [self.arena.keys, self.arena.values, *rings, self.states]

    def pending_writes(self) -> list[mx.array]:
        return self.arrays()

    def before_joins(self, decoded: list[mx.array]) -> None:
        """The decode's reads of the pages come before the joins' writes into them,
        or the writes would copy the whole arena."""
        mx.eval(decoded, self.arrays())


def _per_head(rows: np.ndarray, heads: int) -> mx.array:
    """Each row's `[rows, L]` arena rows repeated for every head, in (row, head,
    position) order: the order update_and_fetch flattens the new KV in."""
    return mx.array(np.repeat(rows[:, None, :], heads, axis=1).reshape(-1), mx.int32)


def _real_positions(a: mx.array, index: mx.array) -> mx.array:
    """`[B, heads, L, dim]` -> the positions `index` of `[B * L, heads, dim]`."""
    b, h, n, d = a.shape
    return a.transpose(0, 2, 1, 3).reshape(b * n, h, d)[index]


def _runs(table: list[int], only: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(index in the table, first page id, pages) of each run of consecutive ids at
    consecutive indices, among the indices `only` (ascending; None: all)."""
    index = range(len(table)) if only is None else only
    runs, i = [], 0
    while i < len(index):
        j, n = index[i], 1
        while (i + n < len(index) and index[i + n] == j + n
               and table[j + n] == table[j] + n):
            n += 1
        runs.append((j, table[j], n))
        i += n
    return runs


def paged_decode_reaches(model, layout: CacheLayout, arena: PageArena) -> bool:
    """Whether a decode in pages reaches every attention layer of the model through
    the hook (a layer calling mx.fast's attention directly would see only the new
    position): one token of two rows prefilled, joined and decoded once."""
    caches = batch_cache.model_caches(layout, [0, 0], [0, 0])
    logits = model(mx.array([[1], [2]]), cache=caches)[:, -1, :]
    batch = PagedDecodeBatch(layout, arena)
    batch.add([JoinGroup([0, 1], [None, None], caches, mx.argmax(logits, axis=-1))])
    mx.eval(batch.forward(model))
    reached = batch.hook_reached()
    batch.clear()
    return reached
