"""The running requests' decode state in pages (decode_pages): one page table per
row, recurrent states (hybrid models) one row each.

With the pool (`pool`, the default for the model): a row's KV is where the prefill
and the decode steps wrote it, the pool's pages (kv_pool.py; the scheduler books
whole pages, position p at offset p mod the page size). A row's table names, per
window of `page` positions, the pool page that holds them, so a join copies
nothing and a prefix several rows start from is read once per row where the tree
keeps it. A window whose positions are not one pool page (a cached prefix that
ends inside a page: its positions in the prefix's page, the rest in the row's
own) is copied into a page of the arena instead (at join, from the prefill cache),
and the positions the row decodes in it are written there and, by the runner, to
their pool slots. Table entries: > 0 a pool page, < 0 an arena page (its negation).

Without a pool (the startup probe, and tests of the arena): every window in
the arena, as the rows' own copy (entries > 0: arena pages).

Each forward builds the caches the model sees (a `PagedLayerCache` per KV leaf, the
persistent state caches) from the tables: where each new position is written and
the (row, page) pairs each window size reads in each store.
"""

import mlx.core as mx
import numpy as np

from . import batch_cache
from .batch_cache import CacheLayout
from .decode import JoinGroup
from .decode_pages import (
    PageArena, PagedLayerCache, Writes, per_head_rows, query_positions, step_pairs, tail_pairs,
)
from .kv_pool import KVPool
from .sampling import RowState


class SlotMismatch(ValueError):
    """A Step names a slot other than the one a row's page puts its position at."""


class PagedDecodeBatch:
    """Rows in order; `row_rids` never holds a released row (release is free).
    `pool`: rows read the pool's pages in place (see the module)."""

    def __init__(self, layout: CacheLayout, arena: PageArena, pool: KVPool | None = None):
        assert pool is None or (pool.page == arena.page and not pool.uses_windows)
        self.layout, self.arena, self.pool = layout, arena, pool
        self.row_rids: list[int] = []
        self.rows: list[RowState] = []
        self.tables: list[list[int]] = []   # per row: per window, its page (see the module)
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
        # the last forward's new positions (rows' in turn): the pool slot each was
        # written at by the forward itself (0: written to the arena only)
        self.direct: list[int] = []

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
        """Tokens the rows' arena pages span (their own copies)."""
        return sum(1 for t in self.tables for e in t if self._in_arena(e)) * self.arena.page

    def _in_arena(self, entry: int) -> bool:
        return entry < 0 if self.pool is not None else entry > 0

    def _arena_page(self, entry: int) -> int:
        return -entry if self.pool is not None else entry

    def _arena_entry(self, page: int) -> int:
        return -page if self.pool is not None else page

    # ---- rows joining and leaving ------------------------------------------

    def add(self, groups: list[JoinGroup]) -> None:
        """Every joining row's table (its windows' pool pages; the rest copied into
        the arena); append the rows."""
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
        tables, fresh, copies = [], [], ([], [])
        for n, row_slots in zip(lengths, slots):
            table, todo = self._table(n, row_slots, copies)
            tables.append(table)
            fresh.append(todo)
        if copies[0]:
            self._copy_in_pool(*copies)
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

    def _table(self, n: int, slots: list[int] | None,
               copies: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
        """The table of a row joining with `n` positions held at pool `slots`: each
        window whose positions are one pool page (position p at offset p mod page)
        reads that page. A window whose positions are in two (a cached prefix ends
        inside a page: the prefix's positions in its page, the row's own in the page
        the row took for the window) reads the row's page, the prefix's positions
        copied into it (`copies`: from, to; the scheduler leaves a page's slots before
        its taker's first position loose, for its taker alone). Any other window
        gets an arena page. Returns (table, indices of the arena pages to write)."""
        page = self.arena.page
        windows = -(-n // page)
        table = [0] * windows
        assert slots is None or len(slots) == n, "a joining row's slots are its positions'"
        if self.pool is not None and slots is not None and n:
            held = np.asarray(slots, np.int64)
            table = _pool_windows(held, page)
            for j in [j for j, e in enumerate(table) if not e]:
                table[j] = _copy_into_own_page(held, j, page, copies)
        todo = [j for j, e in enumerate(table) if not e]
        for j, p in zip(todo, self.arena.allocate(len(todo))):
            table[j] = self._arena_entry(p)
        return table, todo

    def _copy_in_pool(self, sources: list[int], targets: list[int]) -> None:
        """Copy these pool slots' KV (as stored) to those, in every KV layer."""
        src, dst = mx.array(sources, mx.int32), mx.array(targets, mx.int32)
        for layer in range(len(self.pool.keys)):
            self.pool.write_raw(layer, dst, self.pool.read_raw(layer, src))

    def _write_pages(self, kv: list, tables: list[list[int]], fresh: list[list[int]],
                     lefts: list[int], end: int) -> None:
        """Every row's positions of every KV leaf into its fresh arena pages: per run
        of consecutive page ids, one slice of the prefill cache into one slice of
        the arena (columns past the row's end are padding, masked out)."""
        page = self.arena.page
        for r, (table, todo, left) in enumerate(zip(tables, fresh, lefts)):
            arena_table = [self._arena_page(e) for e in table]
            for j, first, n in _runs(arena_table, todo):
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
        """The arena's pages are those the tables hold there; each row holds a ring
        of the float tail of its own."""
        self.arena.check_integrity([[self._arena_page(e) for e in t if self._in_arena(e)]
                                    for t in self.tables])
        if self.arena.tail is not None:
            self.arena.tail.check_integrity([[r] for r in self.rings])

    def _let_go(self, entries: list[int]) -> None:
        """A row lets go of these table entries (its arena pages go back; its pool
        pages are the scheduler's)."""
        self.arena.free([self._arena_page(e) for e in entries if self._in_arena(e)])

    def remove(self, rids: set[int]) -> None:
        """Drop released rows: their arena pages go back, the rest stay where they are."""
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
        """No rows: every arena page free (also after a step that failed midway
        through a join or a growth, whose pages no table names)."""
        self.arena.reset()
        self.row_rids, self.rows, self.tables, self.lengths = [], [], [], []
        self.rings, self.reached = [], []
        self.tokens, self.states, self._leaves = None, [], []
        self._verified = None
        self.direct = []

    # ---- where new positions go --------------------------------------------

    def booked(self, rid_pages: dict[int, int]) -> None:
        """The pool pages (the rows' `DecodeRow.chain_page`) next positions start: their
        tables take them, so a chained decode writes there."""
        if self.pool is None:   # the rows' pages are the arena's, taken as they fill
            return
        page = self.arena.page
        for i, rid in enumerate(self.row_rids):
            q = rid_pages.get(rid, 0)
            if q and len(self.tables[i]) == self.lengths[i] // page:
                self.tables[i].append(q)

    def knows_next(self) -> bool:
        """Every row's next position has its page (a chained decode may run)."""
        page = self.arena.page
        return self.pool is None or all(n // page < len(t)
                                        for t, n in zip(self.tables, self.lengths))

    def _extend_tables(self, queries: list[int], slots: list[list[int]] | None) -> None:
        """Pages for each row's next `queries[i]` positions: in the arena without a
        pool; with one, the pool page the Step's slot for a position starting a
        window names (its offset checked), or, with no slots, the page booked for it.
        A window of scratch positions only (past a row's slots) takes entry 0."""
        page = self.arena.page
        for i, (table, n, q) in enumerate(zip(self.tables, self.lengths, queries)):
            short = -(-(n + q) // page) - len(table)
            if short <= 0:
                continue
            if self.pool is None:
                table += self.arena.allocate(short)
                continue
            for w in range(len(table), len(table) + short):
                p = w * page   # the window's first position; the row's next ones reach it
                at = p - n
                if slots is not None and at >= len(slots[i]):
                    table.append(0)
                    continue
                s = slots[i][at] if slots is not None else 0
                if not s:
                    raise SlotMismatch(f"row {self.row_rids[i]}: no page for position {p}")
                if s % page:
                    raise SlotMismatch(f"row {self.row_rids[i]}: slot {s} for position {p} "
                                       f"is not at its page's offset")
                table.append(s // page)

    def _targets(self, queries: list[int], width: int,
                 slots: list[list[int]] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per row and query slot `[rows, width]`: where each new position goes, as a
        row of the pool (> 0, the pool page's) or of the arena (< 0, negated; 0 for
        padding and scratch positions: the arena's page 0). A Step's slot for a
        position in a pool page must be that position's slot there. With `slots`, a
        row's positions past its slots are scratch (a draft row past its count)."""
        page = self.arena.page
        pool_at = np.zeros((len(self.tables), width), dtype=np.int64)
        arena_at = np.zeros((len(self.tables), width), dtype=np.int64)
        for i, (table, n, q) in enumerate(zip(self.tables, self.lengths, queries)):
            at = n + np.arange(q)
            entries = np.asarray(table, dtype=np.int64)[at // page]
            if self.pool is not None:
                if slots is not None:
                    entries[len(slots[i]):] = 0
                rows = entries * page + at % page
                in_pool = entries > 0
                pool_at[i, :q] = np.where(in_pool, rows, 0)
                arena_at[i, :q] = np.where(in_pool, 0, -entries * page + at % page)
                if slots is not None and in_pool.any():
                    want = np.asarray(slots[i][:q], dtype=np.int64)
                    named = in_pool[:len(want)]   # (scratch positions have no slot)
                    if (want[named] != rows[:len(want)][named]).any():
                        raise SlotMismatch(f"row {self.row_rids[i]}: slots {want.tolist()} "
                                           f"are not its pages' {rows.tolist()}")
            else:
                arena_at[i, :q] = entries * page + at % page
        return pool_at, arena_at

    # ---- decode ----------------------------------------------------------

    def forward(self, model, drafts: list[list[int]] | None = None,
                slots: list[list[int]] | None = None) -> mx.array:
        """Logits `[rows, V]` for the next token of every row (lazy). Each row's
        input goes at its next position: in the pool, at the slot `slots[i][0]` the
        Step names (None: a chained decode, at the slot its page puts it), or, in a
        window the row holds in the arena, there (the runner writes the pool).

        With `drafts` (one list per row, maybe empty), row i's input is its next
        token then `drafts[i]`, at consecutive positions (`slots[i]`: their slots),
        all attended causally in one forward (a verify): logits `[sum(1 +
        len(d)), V]`, each row's positions in turn. A row's positions past its
        `slots[i]` are scratch (a draft model's row that has drafted what it was
        asked): written to the arena's page 0, read by nothing. The rows' lengths count every
        position until `accept` says how many of them hold KV to keep. Recurrent
        states see only each row's own positions (the padding of shorter drafts is
        masked out of them), and a verify's states count all of them: `replay`
        gives the states of the kept ones."""
        queries = [1 + len(d) for d in drafts] if drafts else [1] * len(self.tables)
        width = max(queries)
        self._extend_tables(queries, slots)
        inputs = self.tokens[:, None]
        if width > 1:
            padded = [d + [0] * (width - 1 - len(d)) for d in drafts]
            inputs = mx.concatenate([inputs, mx.array(padded, dtype=inputs.dtype)], axis=1)
        self._verified = (inputs, self.states) if width > 1 and self.states else None
        logits = self._run(model, inputs, queries, slots)
        if width == 1:
            self._positions = None
            return logits[:, -1, :]
        self._positions = mx.array([i * width + j for i, q in enumerate(queries)
                                    for j in range(q)])
        return logits.reshape(-1, logits.shape[-1])[self._positions]

    def _run(self, model, inputs: mx.array, queries: list[int],
             slots: list[list[int]] | None = None) -> mx.array:
        """The model over `inputs` `[rows, width]`, row i's first `queries[i]` of them
        at its next positions (the rest padding: written to the arena's page 0,
        masked out of the attention and of recurrent states); the rows' lengths
        advance by their queries. Logits `[rows, width, V]` (lazy)."""
        heads = self.arena.heads
        width = inputs.shape[1]
        pool_at, arena_at = self._targets(queries, width, slots)
        real = np.arange(width)[None, :] < np.asarray(queries)[:, None]
        self.direct = pool_at[real].tolist()
        writes = Writes.of(pool_at, arena_at, heads)
        offset = mx.array(np.array(self.lengths), mx.int32)
        after = [n + q for n, q in zip(self.lengths, queries)]
        several = queries if width > 1 else None
        ring_rows, lows = self._tail_step(after, queries, width)
        windows = set(self.layout.windows)
        pairs, pool_pairs = {}, {}
        if self.pool is None or any(e < 0 for t in self.tables for e in t):
            arena_tables = [[self._arena_page(e) if self._in_arena(e) else 0 for e in t]
                            for t in self.tables]
            pairs = {w: step_pairs(arena_tables, after, self.arena, w, several, lows)
                     for w in windows}
        if self.pool is not None:
            pool_tables = [[e if e > 0 else 0 for e in t] for t in self.tables]
            pool_pairs = {w: step_pairs(pool_tables, after, self.pool, w, several, lows)
                          for w in windows}
        spans = {w: self._span(after, w, queries[0]) for w in windows}
        tails = {}
        if lows is not None:
            tail_at = (writes.heads, ring_rows)
            tails = {w: (tail_at, tail_pairs(self.rings, after, lows, self.arena.tail, w,
                                             several)) for w in windows}
        self._leaves = [PagedLayerCache(self.arena, i, offset, writes, pairs.get(w), spans[w],
                                        tails.get(w), self.pool, pool_pairs.get(w))
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
        write order; the positions a ring cannot hold, and padding, at ring 0),
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

    def replay(self, model, kept: list[int], slots: list[list[int]] | None = None) -> None:
        """After a verify, before `accept`: every row's recurrent states after its
        first `kept[i]` positions, recomputed from the states before the verify
        (the verify's count every position it checked). The forward writes those
        positions' KV again, as the verify did; its logits are never computed."""
        inputs, before = self._verified
        self.lengths, self.states = self._held, before
        direct = self.direct
        self._run(model, inputs[:, :max(kept)], kept, slots)
        self.direct = direct
        self._verified = None

    def accept(self, kept: list[int], tokens: mx.array, held: list[int] | None = None) -> None:
        """After a verify: row i keeps the KV of its first `kept[i]` new positions
        (its input and the accepted draft tokens) and its next input is `tokens[i]`;
        windows past what it holds now leave its table (arena pages go back). `held`:
        the rows' lengths before the positions counted (default: before the last
        forward)."""
        page = self.arena.page
        for i, (n, k) in enumerate(zip(self._held if held is None else held, kept)):
            self.lengths[i] = n + k
            table = self.tables[i]
            spare = len(table) - -(-(n + k) // page)
            if spare > 0:   # windows of this step's rejected positions
                self._let_go(table[-spare:])
                del table[-spare:]
        self.tokens = tokens

    def _span(self, lengths: list[int], window: int, queries: int = 1):
        """A lone row whose pages are one run in one store: the positions its
        `queries` newest positions attend (from the window start of the first, for a
        windowed layer) as (first row, count, in the pool), attended as one slice."""
        if len(self.tables) != 1:
            return None
        table = self.tables[0]
        in_pool = self.pool is not None and all(e > 0 for e in table)
        if not in_pool and not all(self._in_arena(e) for e in table):
            return None
        pages = table if in_pool else [self._arena_page(e) for e in table]
        if len(_runs(pages)) != 1:
            return None
        n = lengths[0]
        low = max(0, n - (queries - 1) - window) if window else 0
        return pages[0] * self.arena.page + low, n - low, in_pool

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
        pool = [self.pool.keys, self.pool.values] if self.pool is not None else []
        return [self.arena.keys, self.arena.values, *rings, *pool, self.states]

    def pending_writes(self) -> list[mx.array]:
        return self.arrays()

    def before_joins(self, decoded: list[mx.array]) -> None:
        """The decode's reads of the pages come before the prefills' and joins' writes
        into them, or the writes would copy the whole store."""
        mx.eval(decoded, self.arrays())


def _copy_into_own_page(slots: np.ndarray, window: int, page: int,
                        copies: tuple[list[int], list[int]]) -> int:
    """For a window of a row's positions (held at `slots`) that is not one pool page:
    the page its last position is in, when every position is at its offset (the
    positions held elsewhere listed in `copies` to be copied there), else 0."""
    first = window * page
    held = slots[first:first + page]
    offsets = np.arange(len(held))
    if (held % page != offsets).any():
        return 0
    q = int(held[-1]) // page
    elsewhere = held // page != q
    copies[0].extend(held[elsewhere].tolist())
    copies[1].extend((q * page + offsets[elsewhere]).tolist())
    return q


def _pool_windows(slots: np.ndarray, page: int) -> list[int]:
    """Per window of a row's positions (held at `slots`), the pool page holding all of
    them at their offsets, or 0 where they are not one page's."""
    n = len(slots)
    pages = np.where(slots % page == np.arange(n) % page, slots // page, -1)
    first = pages[::page]   # each window's first position's page
    starts = np.arange(0, n, page)
    whole = np.logical_and.reduceat(pages == np.repeat(first, page)[:n], starts)
    return np.where(whole & (first > 0), first, 0).tolist()


def _per_head(rows: np.ndarray, heads: int) -> mx.array:
    """Each row's `[rows, L]` store rows repeated for every head, in the order
    update_and_fetch flattens the new KV in (decode_pages.per_head_rows)."""
    return mx.array(per_head_rows(rows, heads), mx.int32)


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
