"""The running requests' decode state: one batched KV cache, one row per request.

Rows live in one left-padded batch cache per layer (batch_cache). Prefilled
groups join after their prefill and rows leave when released; `forward` decodes
every row at once. Joining rewrites the batch's caches: `batch_cache.merge`
copies every row once, right-aligned at the longest row's end, into a buffer as
wide as kv_layout's rule (the one the scheduler budgets with) says.
"""

import mlx.core as mx

from . import batch_cache
from .batch_cache import LayerCache
from .decode import JoinGroup
from .sampling import RowState


class DecodeBatch:
    """Rows in cache order. A released row stays in the caches as a dead row (rid
    None) until the next join, whose copy leaves it out, until more than
    1/DEAD_SHARE of the rows are dead, or until a decode would grow the caches:
    releasing a row alone would copy the whole batch's KV, and requests finish one
    at a time."""

    DEAD_SHARE = 8
    page = 0   # kv_layout's rule for the padded layout
    pool = None   # its rows hold their KV in their caches, not the pool's

    def __init__(self, layout: batch_cache.CacheLayout | None = None):
        self.row_rids: list[int | None] = []   # per row; None: released, not yet dropped
        self.rows: list[RowState] = []
        self.layout = layout
        # every layer a plain KV cache: merged as such, and they are the KV leaves
        self._merge = batch_cache.merge if layout is None else batch_cache.merge_layer
        self.caches: list[LayerCache] | None = None
        self.kv: list[LayerCache] = []   # the caches' KV leaves, in pool layer order
        self.tokens: mx.array | None = None   # [rows] next input token of each row
        self.direct: list[int] = []   # the last forward wrote no input's KV to the pool

    @property
    def rids(self) -> list[int]:
        """The running requests, in row order."""
        return [rid for rid in self.row_rids if rid is not None]

    def __len__(self) -> int:
        return len(self.row_rids) - self.row_rids.count(None)

    @property
    def cache_tokens(self) -> int:
        """Tokens one layer's cache spans (rows, dead ones too, x width): what the
        scheduler's decode budget counts."""
        return 0 if not self.kv else batch_cache.span(self.kv[0])

    def add(self, groups: list[JoinGroup]) -> None:
        """Join all of a step's new rows with one copy of the running batch (which
        drops its dead rows on the way)."""
        parts, tokens = [], []
        if self.caches is not None:
            live = self._live_index()
            parts.append([(cache, live) for cache in self.caches])
            tokens.append(self.tokens if live is None else self.tokens[live])
            self._forget_dead_rows()
        parts += [[(cache, None) for cache in g.caches] for g in groups]
        self._set_caches([self._merge([part[layer] for part in parts])
                          for layer in range(len(parts[0]))])
        self.tokens = mx.concatenate(tokens + [g.first_tokens for g in groups])
        for group in groups:
            self.row_rids += group.rids
            self.rows += group.rows

    def remove(self, rids: set[int]) -> None:
        if not rids.intersection(self.row_rids):
            return
        self.row_rids = [None if rid in rids else rid for rid in self.row_rids]
        if not len(self):
            self.clear()
        elif self.row_rids.count(None) * self.DEAD_SHARE > len(self.row_rids):
            self.compact()

    def compact(self) -> None:
        """Drop the dead rows from the caches (a copy of the live rows, laid out as
        after a join: mlx_lm's in-place filter leaves a buffer width the rule does
        not count, and the next growth overshoots the budget)."""
        live = self._live_index()
        if live is None:
            return
        self._set_caches([self._merge([(cache, live)]) for cache in self.caches])
        self.tokens = self.tokens[live]
        self._forget_dead_rows()

    def _forget_dead_rows(self) -> None:
        """The row lists, once the caches no longer hold the dead rows."""
        self.rows = [r for r, rid in zip(self.rows, self.row_rids) if rid is not None]
        self.row_rids = self.rids

    def _set_caches(self, caches: list) -> None:
        self.caches = caches
        self.kv = caches if self.layout is None else batch_cache.kv_leaves(self.layout, caches)

    def clear(self) -> None:
        self.row_rids, self.rows, self.caches, self.tokens = [], [], None, None
        self.kv = []

    def forward(self, model, slots: list[list[int]] | None = None) -> mx.array:
        """Logits `[rows, V]` for the next token of every row, dead ones too (lazy);
        `slots` are the pool's business (the runner writes it). A decode that would
        grow the caches drops the dead rows first: the scheduler no longer counts
        them, and growing copies every row anyway."""
        if None in self.row_rids and self.kv and batch_cache.is_full(self.kv[0]):
            self.compact()
        self.direct = [0] * len(self.row_rids)
        return model(self.tokens[:, None], cache=self.caches)[:, -1, :]

    def knows_next(self) -> bool:
        """A chained decode may always run: it writes only the caches."""
        return True

    def booked(self, rid_pages: dict[int, int]) -> None:
        """No pool pages to take: the pool is written by the runner."""

    def newest_kv(self) -> list[tuple[mx.array, mx.array]]:
        """Per layer, keys/values `[rows, heads, dim]` (every row, dead ones too) of
        the position the last forward wrote."""
        return [batch_cache.newest_kv(c) for c in self.kv]

    def arrays(self) -> list[mx.array]:
        """The caches' arrays (what a join's copy computes; lazy until the next
        decode otherwise)."""
        return batch_cache.cache_arrays(self.caches) if self.caches is not None else []

    def pending_writes(self) -> list[mx.array]:
        """None of its own: a decode's cache writes are read by the next decode."""
        return []

    def before_joins(self, decoded: list[mx.array]) -> None:
        """A join copies every row into new caches anyway."""

    def _live_index(self) -> mx.array | None:
        """Positions of the live rows; None when every row is live."""
        if None not in self.row_rids:
            return None
        return mx.array([i for i, rid in enumerate(self.row_rids) if rid is not None])

