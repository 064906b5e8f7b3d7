"""The running requests' decode state: one batched KV cache, one row per request.

Rows live in left-padded `BatchKVCache`s from mlx_lm (one per layer). Prefilled
groups join after their prefill and rows leave when released; `forward` decodes
every row at once.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .sampling import RowState


@dataclass
class JoinGroup:
    """Freshly prefilled requests waiting to join the batch, rows in cache order."""

    rids: list[int]
    rows: list[RowState]
    caches: list[BatchKVCache]
    first_tokens: mx.array   # [B], lazy


class DecodeBatch:
    def __init__(self):
        self.rids: list[int] = []
        self.rows: list[RowState] = []
        self.caches: list[BatchKVCache] | None = None
        self.tokens: mx.array | None = None   # [B] next input token of each row

    def __len__(self) -> int:
        return len(self.rids)

    def add(self, groups: list[JoinGroup]) -> None:
        """Join all of a step's new rows with one copy of the running batch."""
        caches = groups[0].caches
        for group in groups[1:]:
            for cache, new in zip(caches, group.caches):
                cache.extend(new)
        tokens = mx.concatenate([g.first_tokens for g in groups])
        if self.caches is None:
            self.caches, self.tokens = caches, tokens
        else:
            for cache, new in zip(self.caches, caches):
                cache.extend(new)
            self.tokens = mx.concatenate([self.tokens, tokens])
        for group in groups:
            self.rids += group.rids
            self.rows += group.rows

    def remove(self, rids: set[int]) -> None:
        keep = [i for i, rid in enumerate(self.rids) if rid not in rids]
        if len(keep) == len(self.rids):
            return
        if not keep:
            self.clear()
            return
        idx = mx.array(keep)
        for cache in self.caches:
            cache.filter(idx)
        self.tokens = self.tokens[idx]
        self.rids = [self.rids[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]

    def clear(self) -> None:
        self.rids, self.rows, self.caches, self.tokens = [], [], None, None

    def forward(self, model) -> mx.array:
        """Logits `[B, V]` for the next token of every row (lazy)."""
        return model(self.tokens[:, None], cache=self.caches)[:, -1, :]

    def newest_kv(self, layer: int) -> tuple[mx.array, mx.array]:
        """Keys/values `[B, heads, dim]` of the position the last forward wrote."""
        cache = self.caches[layer]
        i = cache.size() - 1
        return cache.keys[:, :, i, :], cache.values[:, :, i, :]
