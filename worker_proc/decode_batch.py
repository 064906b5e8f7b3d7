"""The running requests' decode state: one batched KV cache, one row per request.

Rows live in left-padded `BatchKVCache`s from mlx_lm (one per layer). Prefilled
groups join after their prefill and rows leave when released; `forward` decodes
every row at once.

Joining rewrites the batch's caches (rows are right-aligned at the longest row's
end): `merge` copies every row once into a buffer with room for the next
position. mlx_lm's `BatchKVCache.extend` pads each part, then concatenates, and
the next decode then often grows the full buffer: three copies of the whole
batch's KV for every join, which dominated serving time under steady arrivals.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .memory import cache_width
from .sampling import RowState


class DecodeKVCache(BatchKVCache):
    """mlx_lm's batch cache that also keeps the keys/values of the latest update:
    the decoded positions' KV, for the pool, without reading the cache buffer
    (a pending read of it would stop the next update from reusing the buffer)."""

    newest: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys, values):
        self.newest = (keys, values)
        return super().update_and_fetch(keys, values)


@dataclass
class JoinGroup:
    """Freshly prefilled requests waiting to join the batch, rows in cache order."""

    rids: list[int]
    rows: list[RowState]
    caches: list[BatchKVCache]
    first_tokens: mx.array   # [B], lazy


class DecodeBatch:
    """Rows in cache order. A released row stays in the caches as a dead row (rid
    None) until the next join, whose copy leaves it out, or until more than
    1/DEAD_SHARE of the rows are dead: releasing a row alone would copy the whole
    batch's KV, and requests finish one at a time."""

    DEAD_SHARE = 8

    def __init__(self):
        self.row_rids: list[int | None] = []   # per row; None: released, not yet dropped
        self.rows: list[RowState] = []
        self.caches: list[DecodeKVCache] | None = None
        self.tokens: mx.array | None = None   # [rows] next input token of each row

    @property
    def rids(self) -> list[int]:
        """The running requests, in row order."""
        return [rid for rid in self.row_rids if rid is not None]

    def __len__(self) -> int:
        return len(self.row_rids) - self.row_rids.count(None)

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
        self.caches = [merge([part[layer] for part in parts]) for layer in range(len(parts[0]))]
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
        """Drop the dead rows from the caches (a copy of the live rows)."""
        live = self._live_index()
        if live is None:
            return
        for cache in self.caches:
            cache.filter(live)
        self.tokens = self.tokens[live]
        self._forget_dead_rows()

    def _forget_dead_rows(self) -> None:
        """The row lists, once the caches no longer hold the dead rows."""
        self.rows = [r for r, rid in zip(self.rows, self.row_rids) if rid is not None]
        self.row_rids = self.rids

    def clear(self) -> None:
        self.row_rids, self.rows, self.caches, self.tokens = [], [], None, None

    def forward(self, model) -> mx.array:
        """Logits `[rows, V]` for the next token of every row, dead ones too (lazy)."""
        return model(self.tokens[:, None], cache=self.caches)[:, -1, :]

    def newest_kv(self) -> list[tuple[mx.array, mx.array]]:
        """Per layer, keys/values `[rows, heads, dim]` (every row, dead ones too) of
        the position the last forward wrote."""
        return [(c.newest[0][:, :, -1, :], c.newest[1][:, :, -1, :]) for c in self.caches]

    def _live_index(self) -> mx.array | None:
        """Positions of the live rows; None when every row is live."""
        if None not in self.row_rids:
            return None
        return mx.array([i for i, rid in enumerate(self.row_rids) if rid is not None])


def merge(parts: list[tuple[BatchKVCache, mx.array | None]]) -> DecodeKVCache:
    """One cache with the rows of the parts (a cache, and which of its rows to take:
    None for all), in order, right-aligned at the longest row's end, in a buffer with
    room for at least one more position (the width the scheduler's decode budget
    counts: the end + 2, rounded up to 256). Every row is copied once."""
    pieces = []
    for cache, rows in parts:
        left = cache.left_padding if rows is None else cache.left_padding[rows]
        offset = cache.offset if rows is None else cache.offset[rows]
        start = int(mx.min(left).item()) if cache.keys is not None else cache._idx
        pieces.append((cache, rows, left, offset, start))
    end = max(c._idx - start for c, _, _, _, start in pieces)
    ref = next(c for c, *_ in pieces if c.keys is not None)
    _, heads, _, k_dim = ref.keys.shape
    n_rows = sum(offset.shape[0] for _, _, _, offset, _ in pieces)
    width = cache_width(end + 2)
    keys = mx.zeros((n_rows, heads, width, k_dim), ref.keys.dtype)
    values = mx.zeros((n_rows, heads, width, ref.values.shape[3]), ref.values.dtype)
    row, lefts, offsets = 0, [], []
    for cache, rows, left, offset, start in pieces:
        n, length = offset.shape[0], cache._idx - start
        if length:
            k, v = cache.keys[..., start:cache._idx, :], cache.values[..., start:cache._idx, :]
            if rows is not None:
                k, v = k[rows], v[rows]
            keys[row:row + n, :, end - length:end, :] = k
            values[row:row + n, :, end - length:end, :] = v
        lefts.append(left + (end - length - start))
        offsets.append(offset)
        row += n
    merged = DecodeKVCache([0] * n_rows)
    merged.keys, merged.values, merged._idx = keys, values, end
    merged.offset, merged.left_padding = mx.concatenate(offsets), mx.concatenate(lefts)
    return merged
