"""The decode-attention layouts. Each is built from a `Batch` (its KV laid out as
the layout holds it), then `step()` gives the batch's attention output `[B, Hq, 1,
D]` (lazy), `held()` the bytes of KV it holds, and `join(k, v)` the arrays a row of
KV `[Hkv, L, D]` joining writes (lazy; the cost of the copy, the state unchanged
but for that row's storage) or None where the layout has no join of its own."""

import random

import mlx.core as mx

from mlxd.runtime.kv_layout import row_width

from .attend import class_capacity, grouped, length_mask, merge_partials, partial_attention
from .cases import Batch

sdpa = mx.fast.scaled_dot_product_attention


def pad_positions(a: mx.array, left: int, right: int) -> mx.array:
    """KV `[H, L, D]` padded along positions."""
    return mx.pad(a, [(0, 0), (left, right), (0, 0)])


def by_class(lengths: list[int]) -> dict[int, list[int]]:
    """Row indices by width class (`attend.class_capacity`), narrowest class first."""
    members: dict[int, list[int]] = {}
    for r, length in enumerate(lengths):
        members.setdefault(class_capacity(length), []).append(r)
    return dict(sorted(members.items()))


def inverse_order(members: dict[int, list[int]]) -> mx.array:
    """Where each row's output sits among the classes' outputs, concatenated."""
    order = [r for rows in members.values() for r in rows]
    return mx.array(sorted(range(len(order)), key=order.__getitem__))


class Layout:
    name = ""

    def __init__(self, batch: Batch):
        self.batch, self.shape = batch, batch.shape

    def step(self) -> mx.array:
        raise NotImplementedError

    def arrays(self) -> list[mx.array]:
        """The KV the layout holds (evaluated after building)."""
        raise NotImplementedError

    def held(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def join(self, k: mx.array, v: mx.array) -> list[mx.array] | None:
        return None


class Padded(Layout):
    """Today's: `[B, H, W, D]`, rows right-aligned at the longest row's end (left
    padding), a buffer `kv_layout.row_width` wide, the attention over the longest
    row's columns with a mask; a join copies the whole batch (as `batch_cache.merge`)."""

    name = "padded"

    def __init__(self, batch: Batch):
        super().__init__(batch)
        self.end = end = max(batch.lengths)
        self.cap = cap = row_width(end)
        self.keys, self.values = (
            mx.stack([pad_positions(kv[i], end - kv[i].shape[1], cap - end) for kv in batch.rows])
            for i in (0, 1))
        lengths = mx.array(batch.lengths)[:, None]
        self.mask = (mx.arange(end)[None, :] >= end - lengths)[:, None, None, :]

    def arrays(self):
        return [self.keys, self.values]

    def step(self):
        k, v = self.keys[:, :, :self.end], self.values[:, :, :self.end]
        return sdpa(self.batch.q, k, v, scale=self.shape.scale, mask=self.mask)

    def join(self, k, v):
        length = k.shape[1]   # no longer than the batch's rows here: the width stays
        rows = [pad_positions(a, self.end - length, self.cap - self.end)[None] for a in (k, v)]
        return [mx.concatenate([self.keys, rows[0]]), mx.concatenate([self.values, rows[1]])]


class PaddedByHand(Padded):
    """The padded layout with the attention written out (scores, softmax, @ V):
    whether mx.fast's sdpa is any faster on this backend."""

    name = "padded, hand-written"

    def __init__(self, batch: Batch, like: Padded | None = None):
        if like is None:
            super().__init__(batch)
        else:   # the same buffers as `like`: only the attention differs
            self.__dict__.update(like.__dict__)

    def step(self):
        k, v = self.keys[:, :, :self.end], self.values[:, :, :self.end]
        q = grouped(self.batch.q, self.shape.kv_heads)
        out, _ = partial_attention(q, k, v, self.shape.scale, self.mask)
        return out.reshape(self.batch.q.shape)


class WidthClasses(Layout):
    """Rows grouped by capacity (`attend.class_capacity`: powers of two x 256),
    each class a `[rows, H, capacity, D]` buffer, rows left-aligned, with room for
    `row_step`-rounded rows so a join writes its row in place; one sdpa per class
    over the class's longest row with a length mask; outputs back in row order."""

    name = "width classes"
    row_step = 8

    def __init__(self, batch: Batch):
        super().__init__(batch)
        members = by_class(batch.lengths)
        self.classes = {cap: self._build(cap, rows) for cap, rows in members.items()}
        self.inverse = inverse_order(members)

    def _build(self, cap: int, rows: list[int]) -> dict:
        lengths = [self.batch.lengths[r] for r in rows]
        room = -(-len(rows) // self.row_step) * self.row_step - len(rows)
        stored = [self.batch.rows[r] for r in rows]
        keys, values = (
            mx.pad(mx.stack([pad_positions(kv[i], 0, cap - kv[i].shape[1]) for kv in stored]),
                   [(0, room), (0, 0), (0, 0), (0, 0)])
            for i in (0, 1))
        width = max(lengths)
        return {"rows": mx.array(rows), "n": len(rows), "width": width, "keys": keys,
                "values": values, "mask": length_mask(lengths, width)}

    def arrays(self):
        return [a for c in self.classes.values() for a in (c["keys"], c["values"])]

    def step(self):
        outs = []
        for c in self.classes.values():
            n, w = c["n"], c["width"]
            outs.append(sdpa(self.batch.q[c["rows"]], c["keys"][:n, :, :w],
                             c["values"][:n, :, :w], scale=self.shape.scale, mask=c["mask"]))
        return mx.concatenate(outs)[self.inverse] if len(outs) > 1 else outs[0]

    def join(self, k, v):
        cap = class_capacity(k.shape[1])
        c = self.classes.get(cap)
        if c is None or c["n"] == c["keys"].shape[0]:
            return None   # a new class, or a full one: a copy of the class (not measured)
        c["keys"][c["n"]] = pad_positions(k, 0, cap - k.shape[1])
        c["values"][c["n"]] = pad_positions(v, 0, cap - v.shape[1])
        return [c["keys"], c["values"]]


class PerRow(Layout):
    """Each row its own `[1, H, capacity, D]` buffer (capacity as mlx_lm's KVCache
    grows it), one sdpa per row over its own length."""

    name = "per-row"

    def __init__(self, batch: Batch):
        super().__init__(batch)
        self.buffers = [self._buffer(k, v) for k, v in batch.rows]

    @staticmethod
    def _buffer(k, v):
        cap = row_width(k.shape[1])
        return tuple(pad_positions(a, 0, cap - a.shape[1])[None] for a in (k, v))

    def arrays(self):
        return [a for kv in self.buffers for a in kv]

    def step(self):
        q, outs = self.batch.q, []
        for r, ((k, v), length) in enumerate(zip(self.buffers, self.batch.lengths)):
            outs.append(sdpa(q[r:r + 1], k[:, :, :length], v[:, :, :length],
                             scale=self.shape.scale))
        return mx.concatenate(outs)

    def join(self, k, v):
        return list(self._buffer(k, v))


class SlotPool:
    """KV held once in a slot pool `[C + 1, H, D]` (slot 0: padding), as
    worker_proc/kv_pool.py; the shared prefix's slots are every row's. Slots are
    handed out in a shuffled order, as a pool in use would have them."""

    def __init__(self, batch: Batch, spare: int):
        p = batch.case.prefix_len
        own = [length - p for length in batch.lengths]
        free = list(range(1, p + sum(own) + spare + 1))
        random.Random(0).shuffle(free)
        prefix_slots, free = free[:p], free[p:]
        self.tables = []
        for n in own:
            self.tables.append(prefix_slots + free[:n])
            free = free[n:]
        self.free = free
        slots = prefix_slots + [s for t in self.tables for s in t[p:]]
        parts = [batch.prefix] if batch.prefix else []
        parts += [batch.suffix(r) for r in range(len(own))]
        shape = (len(slots) + spare + 1, batch.shape.kv_heads, batch.shape.head_dim)
        self.keys, self.values = (mx.zeros(shape, batch.shape.dtype) for _ in (0, 1))
        idx = mx.array(slots)
        self.keys[idx] = mx.concatenate([kv[0] for kv in parts], axis=1).swapaxes(0, 1)
        self.values[idx] = mx.concatenate([kv[1] for kv in parts], axis=1).swapaxes(0, 1)


class GatherThenAttend(Layout):
    """KV in a slot pool; each step gathers each width class's rows from the slot
    table into `[rows, H, longest, D]`, then one sdpa per class. Joins write only
    the row's slots; the gather (a copy of every row's KV, every step) is the price."""

    name = "gather-then-attend"

    def __init__(self, batch: Batch):
        super().__init__(batch)
        self.pool = SlotPool(batch, batch.case.join_len)
        members = by_class(batch.lengths)
        self.classes = [self._class(rows) for rows in members.values()]
        self.inverse = inverse_order(members)

    def _class(self, rows: list[int]) -> tuple:
        lengths = [self.batch.lengths[r] for r in rows]
        width = max(lengths)
        table = [self.pool.tables[r] + [0] * (width - len(self.pool.tables[r])) for r in rows]
        return mx.array(rows), mx.array(table), length_mask(lengths, width)

    def arrays(self):
        return [self.pool.keys, self.pool.values]

    def step(self):
        outs = []
        for rows, table, mask in self.classes:
            k = self.pool.keys[table].transpose(0, 2, 1, 3)
            v = self.pool.values[table].transpose(0, 2, 1, 3)
            outs.append(sdpa(self.batch.q[rows], k, v, scale=self.shape.scale, mask=mask))
        return mx.concatenate(outs)[self.inverse] if len(outs) > 1 else outs[0]

    def join(self, k, v):
        slots = mx.array(self.pool.free[:k.shape[1]])
        self.pool.keys[slots] = k.swapaxes(0, 1)
        self.pool.values[slots] = v.swapaxes(0, 1)
        return [self.pool.keys, self.pool.values]
