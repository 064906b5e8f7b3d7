"""Layouts that attend over pieces of a row's KV and merge the partial softmaxes
by log-sum-exp: the cascade (a shared prefix held and attended once) and pages
read in place by `mx.gather_mm`."""

import mlx.core as mx

from .attend import (
    class_capacity, grouped, length_mask, merge_partials, partial_attention, softmax_parts,
)
from .cases import Batch
from .layouts import Layout, pad_positions


class Cascade(Layout):
    """The shared prefix held once (`[H, P, D]`) and attended by every row's
    queries in one product; each row's own positions in a `[B, H, capacity, D]`
    buffer attended per row (masked); the two partials merged."""

    name = "cascade"

    def __init__(self, batch: Batch):
        super().__init__(batch)
        self.prefix = batch.prefix
        own = [length - batch.case.prefix_len for length in batch.lengths]
        cap, self.width = class_capacity(max(own)), max(own)
        suffixes = [batch.suffix(r) for r in range(len(own))]
        self.keys, self.values = (
            mx.stack([pad_positions(kv[i], 0, cap - kv[i].shape[1]) for kv in suffixes])
            for i in (0, 1))
        self.mask = length_mask(own, self.width)

    def arrays(self):
        return [*self.prefix, self.keys, self.values]

    def step(self):
        q = grouped(self.batch.q, self.shape.kv_heads)   # [B, Hkv, G, D]
        b, h, g, d = q.shape
        shared = q.transpose(1, 0, 2, 3).reshape(h, b * g, d)   # every row's queries, per head
        out_p, lse_p = partial_attention(shared, *self.prefix, self.shape.scale)
        out_p = out_p.reshape(h, b, g, d).transpose(1, 0, 2, 3)
        lse_p = lse_p.reshape(h, b, g).transpose(1, 0, 2)
        w = self.width
        own = partial_attention(q, self.keys[:, :, :w], self.values[:, :, :w],
                                self.shape.scale, self.mask)
        out = merge_partials((out_p, lse_p), own)
        return out.reshape(self.batch.q.shape).astype(self.batch.q.dtype)


class Paged(Layout):
    """KV held once in pages `[pages + 1, H, page, D]` (page 0: padding); a row is
    a list of pages (a shared prefix's full pages are every row's). A step is one
    `gather_mm` over every (row, page) pair for the scores and one for weights @ V,
    reading the pages in place, then each row's pairs merged by log-sum-exp
    (scatter max / add). Joins write only the row's pages."""

    name = "paged (gather_mm)"

    def __init__(self, batch: Batch, page: int = 256):
        super().__init__(batch)
        self.page = page
        chunks, pairs = self._paginate(batch)
        h, d = self.shape.kv_heads, self.shape.head_dim
        spare = -(-batch.case.join_len // self.page)
        zero = mx.zeros((h, self.page, d), self.shape.dtype)
        self.keys, self.values = (
            mx.stack([zero] + [pad_positions(c[i], 0, self.page - c[i].shape[1]) for c in chunks]
                     + [zero] * spare) for i in (0, 1))
        self.spare = list(range(len(chunks) + 1, len(chunks) + 1 + spare))
        rows = mx.array([r for r, _, _ in pairs])
        pages = mx.array([p for _, p, _ in pairs])
        heads = mx.arange(h)
        self.pair_rows = rows
        self.lhs = (rows[:, None] * h + heads).reshape(-1).astype(mx.uint32)
        self.rhs = (pages[:, None] * h + heads).reshape(-1).astype(mx.uint32)
        self.mask = length_mask([n for _, _, n in pairs], self.page)

    def _paginate(self, batch: Batch) -> tuple[list, list]:
        """Page contents (KV `[H, n, D]`, n <= page) and the (row, page, positions)
        pairs; the prefix's full pages are stored once and shared."""
        shared = batch.case.prefix_len // self.page * self.page
        chunks = [tuple(a[:, s:s + self.page] for a in batch.prefix)
                  for s in range(0, shared, self.page)]
        pairs = []
        for r, (k, v) in enumerate(batch.rows):
            pairs += [(r, i + 1, self.page) for i in range(shared // self.page)]
            for s in range(shared, k.shape[1], self.page):
                chunks.append((k[:, s:s + self.page], v[:, s:s + self.page]))
                pairs.append((r, len(chunks), chunks[-1][0].shape[1]))
        return chunks, pairs

    def arrays(self):
        return [self.keys, self.values]

    def step(self):
        b, h, d = len(self.batch.rows), self.shape.kv_heads, self.shape.head_dim
        q = grouped(self.batch.q * self.shape.scale, h).reshape(b * h, -1, d)
        g, n = q.shape[1], self.pair_rows.shape[0]
        keys = self.keys.reshape(-1, self.page, d).swapaxes(-1, -2)
        scores = mx.gather_mm(q, keys, self.lhs, self.rhs).reshape(n, h, g, self.page)
        weights, total, lse = softmax_parts(scores, self.mask)
        values = self.values.reshape(-1, self.page, d)
        out = mx.gather_mm(weights.reshape(n * h, g, self.page), values,
                           mx.arange(n * h, dtype=mx.uint32), self.rhs)
        out = out.reshape(n, h, g, d) / total
        return self._merge(out, lse, b).reshape(self.batch.q.shape).astype(self.batch.q.dtype)

    def _merge(self, out: mx.array, lse: mx.array, b: int) -> mx.array:
        """Each row's attention from its pairs' (output, lse)."""
        rows = self.pair_rows
        peak = mx.full((b, *lse.shape[1:]), -mx.inf).at[rows].maximum(lse)
        w = mx.exp(lse - peak[rows])
        total = mx.zeros(peak.shape).at[rows].add(w)
        merged = mx.zeros((b, *out.shape[1:])).at[rows].add(w[..., None] * out)
        return merged / total[..., None]

    def join(self, k, v):
        pages = self.spare[:-(-k.shape[1] // self.page)]
        for i, p in enumerate(pages):
            self.keys[p] = self._page(k, i)
            self.values[p] = self._page(v, i)
        return [self.keys, self.values]

    def _page(self, a: mx.array, i: int) -> mx.array:
        """The i-th page of KV `[H, L, D]`, padded to a whole page."""
        part = a[:, i * self.page:(i + 1) * self.page]
        return pad_positions(part, 0, self.page - part.shape[1])


def prefix_product(batch: Batch, by_hand: bool):
    """The cascade's shared-prefix attention alone (every row's queries against the
    prefix in one product), by hand or by mx.fast's sdpa: a step function."""
    q = grouped(batch.q, batch.shape.kv_heads)
    b, h, g, d = q.shape
    shared = q.transpose(1, 0, 2, 3).reshape(h, b * g, d)
    if by_hand:
        return lambda: partial_attention(shared, *batch.prefix, batch.shape.scale)[0]
    queries = batch.q.reshape(b, h * g, d).swapaxes(0, 1)[None]   # [1, Hq, B, D]
    keys, values = (a[None] for a in batch.prefix)
    return lambda: mx.fast.scaled_dot_product_attention(queries, keys, values,
                                                        scale=batch.shape.scale)
