"""The running requests' decode state in pages (decode_pages): one page table per
row over the KV pool, recurrent states (hybrid models) one row each.

A row's KV is where the prefill and the decode steps wrote it, the pool's pages
(kv_pool.py; the scheduler books whole pages, position p at offset p mod the page
size). A row's table names, per window of `page` positions, the pool page that
holds them, so a join copies nothing and a prefix several rows start from is read
once per row where the tree keeps it. A window whose positions are in two pages (a
cached prefix that ends inside a page: its positions in the prefix's page, the rest
in the row's own) is completed in the row's own page (the prefix's positions copied
there, as stored); slots not at their page's offsets are refused (`SlotMismatch`).
Nothing else holds KV: the arena beside the pool (decode_pages.PageArena) has only
its page 0, where padding and scratch positions are written and nothing reads, and,
with quantized pages, the rows' float tails.

Each forward builds the caches the model sees (a `PagedLayerCache` per KV leaf, the
persistent state caches) from the tables: where each new position is written and
the (row, page) pairs each window size reads.
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
    """Rows in order; `row_rids` never holds a released row (release is free). Rows
    read `pool`'s pages in place (see the module); `arena` has their float tails."""

    def __init__(self, layout: CacheLayout, arena: PageArena, pool: KVPool):
        if pool.page != arena.page or pool.uses_windows:
            raise ValueError("the paged decode reads a pool of pages of "
                             f"{arena.page} positions with no window pool")
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
        self._verified = None   # a verify's (inputs, states before it), with states
        # the last forward's new positions (rows' in turn): the pool slot each was
        # written at by the forward itself (0: a scratch position)
        self.direct: list[int] = []

    @property
    def page(self) -> int:
        return self.arena.page

    @property
    def rids(self) -> list[int]:
        return list(self.row_rids)

    def __len__(self) -> int:
        return len(self.row_rids)

    # ---- rows joining and leaving ------------------------------------------

    def add(self, groups: list[JoinGroup]) -> None:
        """Every joining row's table (its windows' pool pages); append the rows."""
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
        copies = ([], [])
        tables = [self._table(rid, n, row_slots, copies)
                  for rid, n, row_slots in zip(group.rids, lengths, slots)]
        if copies[0]:
            self._copy_in_pool(*copies)
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

    def _table(self, rid: int, n: int, slots: list[int] | None,
               copies: tuple[list[int], list[int]]) -> list[int]:
        """The table of a row joining with `n` positions held at pool `slots`: each
        window whose positions are one pool page (position p at offset p mod page)
        reads that page. A window whose positions are in two (a cached prefix ends
        inside a page: the prefix's positions in its page, the row's own in the page
        the row took for the window) reads the row's page, the prefix's positions
        copied into it (`copies`: from, to; the scheduler leaves a page's slots before
        its taker's first position loose, for its taker alone)."""
        if not n:
            return []
        if slots is None or len(slots) != n:
            raise SlotMismatch(f"row {rid} joins with {n} positions but "
                               f"{0 if slots is None else len(slots)} slots")
        page = self.arena.page
        held = np.asarray(slots, np.int64)
        table = _pool_windows(held, page)
        for j in [j for j, e in enumerate(table) if not e]:
            table[j] = _copy_into_own_page(held, j, page, copies)
        if not all(table):
            w = table.index(0)
            raise SlotMismatch(f"row {rid}: the slots of positions {w * page}.. "
                               f"({slots[w * page:w * page + 4]}...) are not at their "
                               f"page's offsets")
        return table

    def _copy_in_pool(self, sources: list[int], targets: list[int]) -> None:
        """Copy these pool slots' KV (as stored) to those, in every KV layer. The
        reads are computed first: a read of the pool still pending when its write
        runs keeps MLX from writing in place (the write would copy the layer's pool)."""
        src, dst = mx.array(sources, mx.int32), mx.array(targets, mx.int32)
        read = [self.pool.read_raw(layer, src) for layer in range(len(self.pool.keys))]
        mx.eval(read)
        for layer, parts in enumerate(read):
            self.pool.write_raw(layer, dst, parts)

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
        """Each row holds a ring of the float tail of its own."""
        if self.arena.tail is not None:
            self.arena.tail.check_integrity([[r] for r in self.rings])

    def remove(self, rids: set[int]) -> None:
        """Drop released rows (their rings go back; their pages are the scheduler's)."""
        if not rids.intersection(self.row_rids):
            return
        keep = [i for i, rid in enumerate(self.row_rids) if rid not in rids]
        if not keep:
            self.clear()
            return
        if self.rings:
            self.arena.tail.free([self.rings[i] for i, rid in enumerate(self.row_rids)
                                  if rid in rids])
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
        """No rows: every ring free (also after a step that failed midway through a
        join or a growth, whose rings no row names)."""
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
        page = self.arena.page
        for i, rid in enumerate(self.row_rids):
            q = rid_pages.get(rid, 0)
            if q and len(self.tables[i]) == self.lengths[i] // page:
                self.tables[i].append(q)

    def knows_next(self) -> bool:
        """Every row's next position has its page (a chained decode may run)."""
        page = self.arena.page
        return all(n // page < len(t) for t, n in zip(self.tables, self.lengths))

    def _extend_tables(self, queries: list[int], slots: list[list[int]] | None) -> None:
        """Pages for each row's next `queries[i]` positions: the pool page the Step's
        slot for a position starting a window names (its offset checked), or, with
        no slots, the page booked for it. A window of scratch positions only (past a
        row's slots) takes entry 0."""
        page = self.arena.page
        for i, (table, n, q) in enumerate(zip(self.tables, self.lengths, queries)):
            short = -(-(n + q) // page) - len(table)
            if short <= 0:
                continue
            for w in range(len(table), len(table) + short):
                p = w * page   # the window's first position; the row's next ones reach it
                at = p - n
                if slots is not None and at >= len(slots[i]):
                    table.append(0)
                    continue
                s = slots[i][at] if slots is not None and at >= 0 else 0
                if not s:
                    raise SlotMismatch(f"row {self.row_rids[i]}: no page for position {p}")
                if s % page:
                    raise SlotMismatch(f"row {self.row_rids[i]}: slot {s} for position {p} "
                                       f"is not at its page's offset")
                table.append(s // page)

    def _targets(self, queries: list[int], width: int,
                 slots: list[list[int]] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per row and query slot `[rows, width]`: the pool row each new position is
        written at (0: none), and the arena's page 0 row of the rest (padding, and
        scratch positions: with `slots`, a row's positions past its slots, as a draft
        row's past its count). A Step's slot must be its position's in the row's page."""
        page = self.arena.page
        pool_at = np.zeros((len(self.tables), width), dtype=np.int64)
        arena_at = np.zeros((len(self.tables), width), dtype=np.int64)
        for i, (table, n, q) in enumerate(zip(self.tables, self.lengths, queries)):
            at = n + np.arange(q)
            entries = np.asarray(table, dtype=np.int64)[at // page]
            named = q if slots is None else min(q, len(slots[i]))
            entries[named:] = 0
            rows = entries * page + at % page
            pool_at[i, :q] = np.where(entries > 0, rows, 0)
            arena_at[i, :q] = np.where(entries > 0, 0, at % page)
            if slots is not None and (np.asarray(slots[i][:named]) != rows[:named]).any():
                raise SlotMismatch(f"row {self.row_rids[i]}: slots {slots[i][:named]} are "
                                   f"not its pages' {rows[:named].tolist()}")
        return pool_at, arena_at

    # ---- decode ----------------------------------------------------------

    def forward(self, model, drafts: list[list[int]] | None = None,
                slots: list[list[int]] | None = None) -> mx.array:
        """Logits `[rows, V]` for the next token of every row (lazy). Each row's
        input goes at its next position in the pool, at the slot `slots[i][0]` the
        Step names (None: a chained decode, at the slot its page puts it).

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
            return logits[:, -1, :]
        real = mx.array([i * width + j for i, q in enumerate(queries) for j in range(q)])
        return logits.reshape(-1, logits.shape[-1])[real]

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
        pairs = {w: step_pairs(self.tables, after, self.pool, w, several, lows)
                 for w in windows}
        spans = {w: self._span(after, w, queries[0]) for w in windows}
        tails = {}
        if lows is not None:
            tail_at = (writes.heads, ring_rows)
            tails = {w: (tail_at, tail_pairs(self.rings, after, lows, self.arena.tail, w,
                                             several)) for w in windows}
        self._leaves = [PagedLayerCache(self.arena, i, offset, writes, None, spans[w],
                                        tails.get(w), self.pool, pairs[w])
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
        windows past what it holds now leave its table. `held`:
        the rows' lengths before the positions counted (default: before the last
        forward)."""
        page = self.arena.page
        for i, (n, k) in enumerate(zip(self._held if held is None else held, kept)):
            self.lengths[i] = n + k
            table = self.tables[i]
            spare = len(table) - -(-(n + k) // page)
            if spare > 0:   # windows of this step's rejected positions
                del table[-spare:]
        self.tokens = tokens

    def _span(self, lengths: list[int], window: int, queries: int = 1):
        """A lone row whose pages are one run: the positions its `queries` newest
        positions attend (from the window start of the first, for a windowed layer)
        as (first pool row, count, True), attended as one slice."""
        if len(self.tables) != 1:
            return None
        table = self.tables[0]
        if not all(table) or len(_runs(table)) != 1:
            return None
        n = lengths[0]
        low = max(0, n - (queries - 1) - window) if window else 0
        return table[0] * self.arena.page + low, n - low, True

    def newest_kv(self) -> list[tuple[mx.array, mx.array]]:
        """None to write: the forward wrote every new position to the pool itself
        (`direct`)."""
        return []

    def hook_reached(self) -> bool:
        """The last forward's attention went through every KV leaf's `attend`."""
        return all(c.attended for c in self._leaves)

    def arrays(self) -> list[mx.array]:
        """What a step evaluates to complete the batch's writes."""
        tail = self.arena.tail
        rings = [tail.keys, tail.values] if tail is not None else []
        return [self.arena.keys, self.arena.values, *rings, self.pool.keys,
                self.pool.values, self.states]

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


def _runs(table: list[int]) -> list[tuple[int, int, int]]:
    """(index in the table, first page id, pages) of each run of consecutive ids at
    consecutive indices."""
    runs, j = [], 0
    while j < len(table):
        n = 1
        while j + n < len(table) and table[j + n] == table[j] + n:
            n += 1
        runs.append((j, table[j], n))
        j += n
    return runs


def paged_decode_reaches(model, layout: CacheLayout, arena: PageArena, pool: KVPool) -> bool:
    """Whether a decode in pages reaches every attention layer of the model through
    the hook (a layer calling mx.fast's attention directly would see only the new
    position): one token of two rows (in the first two pages of `pool`) prefilled,
    joined and decoded once."""
    page = pool.page
    caches = batch_cache.model_caches(layout, [0, 0], [0, 0])
    logits = model(mx.array([[1], [2]]), cache=caches)[:, -1, :]
    batch = PagedDecodeBatch(layout, arena, pool)
    batch.add([JoinGroup([0, 1], [None, None], caches, mx.argmax(logits, axis=-1),
                         [[page], [2 * page]])])
    mx.eval(batch.forward(model, slots=[[page + 1], [2 * page + 1]]))
    reached = batch.hook_reached()
    batch.clear()
    return reached
