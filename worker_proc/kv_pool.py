"""The slot-indexed KV pool. The scheduler books slot ids; this stores what they hold.

Per layer, keys and values are `[n_kv_heads, capacity + page, head_dim]`, head-major:
slot s of a head is row s, and the slots come in pages of `page` (the scheduler's
allocator hands out whole pages, position p of a request at offset p mod page), so
one head's page is `page` consecutive rows: the decode attends a request's pages
where they lie (worker_proc/paged_batch.py), and a page of one head is a matrix of
`[heads * (pages + 1), page, dim]`, a free reshape. Page 0 is padding (slot 0) and
never handed out. Writes are scatters at the slot ids the scheduler sent; MLX
donates the pool buffer, so a write costs the rows written, not the pool.

Sliding-window layers may get a smaller pool of their own, the window pool: their
arrays are `[window_capacity + 1, n_kv_heads, head_dim]`, indexed by window ids the
scheduler books per position but holds only for the positions a window may still
reach. Window id 0 means "not held": its row stays zeros (never written), which a
prefix position older than the window reads and the window mask never reaches.

Models with recurrent layers also get a `StatePool`: per state array,
`[state_slots + 1, ...]`, one slot per request's state (slot 0: the zero state,
never written). Its slot ids are booked by the scheduler too.
"""

from dataclasses import dataclass

import mlx.core as mx

from .batch_cache import CacheLayout
from .kv_quant import GROUP, KVFormat


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int             # KV layers (a sliding-window layer is one)
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype
    layout: CacheLayout | None = None   # None: every layer a plain KV cache
    # per state leaf, per array: (shape without the row axis, dtype)
    state_shapes: tuple = ()
    k_bits: int = 0   # stored keys and values in MLX affine groups (--kv-bits; 0: float)
    v_bits: int = 0
    kv_group: int = GROUP   # their values per scale and bias (--kv-group-size)

    @property
    def cache_layout(self) -> CacheLayout:
        return self.layout or CacheLayout.all_kv(self.num_layers)

    @property
    def k_format(self) -> KVFormat:
        return KVFormat.of(self.dtype, self.k_bits, self.k_head_dim, self.kv_group)

    @property
    def v_format(self) -> KVFormat:
        return KVFormat.of(self.dtype, self.v_bits, self.v_head_dim, self.kv_group)

    @property
    def bytes_per_layer_token(self) -> int:
        """Stored KV of one token in one layer (every store holds it alike)."""
        return self.n_kv_heads * (self.k_format.token_bytes(self.k_head_dim) +
                                  self.v_format.token_bytes(self.v_head_dim))

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_layer_token

    @property
    def max_window(self) -> int:
        """The largest sliding window (0: no windowed layer)."""
        return max(self.cache_layout.windows, default=0)

    @property
    def bytes_per_window_token(self) -> int:
        """KV of one token in the sliding-window layers only."""
        windowed = sum(1 for w in self.cache_layout.windows if w)
        return windowed * self.bytes_per_layer_token

    @property
    def bytes_per_state(self) -> int:
        """One request's recurrent state, all layers (0 for attention-only models)."""
        total = 0
        for arrays in self.state_shapes:
            for shape, dtype in arrays:
                n = dtype.size
                for d in shape:
                    n *= d
                total += n
        return total


class StatePool:
    def __init__(self, geometry: KVGeometry, slots: int):
        self.slots = slots
        self.arrays = [[mx.zeros((slots + 1, *shape), dtype) for shape, dtype in leaf]
                       for leaf in geometry.state_shapes]
        mx.eval(self.arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for leaf in self.arrays for a in leaf)

    def check_slots(self, slot_ids: list[int]) -> None:
        if slot_ids and (min(slot_ids) < 0 or max(slot_ids) > self.slots):
            raise ValueError(f"state slot id outside 0..{self.slots}")

    def write(self, leaf: int, slots: mx.array, arrays: list[mx.array]) -> None:
        for i, a in enumerate(arrays):
            self.arrays[leaf][i][slots] = a.astype(self.arrays[leaf][i].dtype)

    def read(self, leaf: int, slots: mx.array) -> list[mx.array]:
        return [a[slots] for a in self.arrays[leaf]]


@dataclass(frozen=True)
class WriteIds:
    """Where a write's n positions go: every one at its slot id in the global
    layers; with a window pool, in the windowed layers only those whose window id
    is not 0 (`window_rows` of the n; None: all of them), at those ids."""

    slots: mx.array
    windows: mx.array
    window_rows: mx.array | None


def write_ids(slot_ids: list[int], window_ids: list[int]) -> WriteIds:
    """`WriteIds` for positions with these slot and window ids (window ids empty:
    no window pool)."""
    rows = [i for i, w in enumerate(window_ids) if w]
    kept = None if len(rows) == len(window_ids) else mx.array(rows, mx.int32)
    return WriteIds(mx.array(slot_ids, mx.int32),
                    mx.array([window_ids[i] for i in rows], mx.int32), kept)


class KVPool:
    """KV layers indexed by slot ids; with `window_capacity` > 0 and windowed layers
    in the geometry's layout, those layers indexed by window ids instead. Each
    layer's keys and values are lists of parts (kv_quant.py: one float array, or
    quantized codes, scales, biases)."""

    def __init__(self, geometry: KVGeometry, capacity: int, state_slots: int = 0,
                 window_capacity: int = 0, page: int = 1):
        g = geometry
        self.geometry = g
        self.page = page
        self.capacity = capacity // page * page
        self.window_capacity = window_capacity if g.max_window else 0
        self.window = g.max_window if self.window_capacity else 0
        self.k_format, self.v_format = g.k_format, g.v_format
        self.keys = [self.k_format.zeros((g.n_kv_heads, self._rows(i)), g.k_head_dim)
                     for i in range(g.num_layers)]
        self.values = [self.v_format.zeros((g.n_kv_heads, self._rows(i)), g.v_head_dim)
                       for i in range(g.num_layers)]
        self.states = StatePool(g, state_slots) if g.state_shapes else None
        mx.eval(self.keys, self.values)

    def _rows(self, layer: int) -> int:
        if self.windowed(layer):
            return self.window_capacity + 1
        return self.capacity + self.page

    @property
    def pages(self) -> int:
        """Pages of the pool's KV layers (page 0 beyond them)."""
        return self.capacity // self.page

    @property
    def uses_windows(self) -> bool:
        """The windowed layers live in the window pool (indexed by window ids)."""
        return self.window_capacity > 0

    def windowed(self, layer: int) -> bool:
        """Layer `layer` is in the window pool."""
        return self.uses_windows and self.geometry.cache_layout.windows[layer] > 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for parts in self.keys + self.values for a in parts)

    @property
    def arrays(self) -> list:
        """Everything a step's writes change (evaluated with the step)."""
        if self.states is None:
            return [self.keys, self.values]
        return [self.keys, self.values, self.states.arrays]

    def check_slots(self, slot_ids: list[int]) -> None:
        top = self.capacity + self.page - 1
        if slot_ids and (min(slot_ids) < 1 or max(slot_ids) > top):
            raise ValueError(f"slot id outside 1..{top}")

    def check_window_ids(self, window_ids: list[int]) -> None:
        """Window ids are 0 (not held) or a window pool row."""
        if window_ids and not self.uses_windows:
            raise ValueError("window ids sent to a worker without a window pool")
        if window_ids and (min(window_ids) < 0 or max(window_ids) > self.window_capacity):
            raise ValueError(f"window id outside 0..{self.window_capacity}")

    @property
    def heads(self) -> int:
        return self.geometry.n_kv_heads

    def write_at(self, layer: int, heads: mx.array, rows: mx.array, keys: mx.array,
                 values: mx.array) -> None:
        """Store `[n, dim]` keys/values at (head, slot) pairs (a decode's positions
        written where its rows read them)."""
        parts = self.k_format.encode(keys) + self.v_format.encode(values)
        for target, part in zip(self.keys[layer] + self.values[layer], parts, strict=True):
            target[heads, rows] = part

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store `[n, heads, dim]` keys/values at `slots` (an int32 array of n ids)."""
        self.write_raw(layer, slots, self.k_format.encode(keys) + self.v_format.encode(values))

    def write_raw(self, layer: int, slots: mx.array, parts: list[mx.array]) -> None:
        """Store parts as `read_raw` gives them (keys' then values', `[n, heads, ...]`)."""
        stored = self.keys[layer] + self.values[layer]
        for target, part in zip(stored, parts, strict=True):
            target[:, slots] = part.swapaxes(0, 1)

    def write_layers(self, kv: list[tuple[mx.array, mx.array]], ids: WriteIds,
                     rows: mx.array | None = None) -> None:
        """Store a forward's per-layer KV `[n, heads, dim]` at `ids`, taking its
        positions `rows` when given (the n positions `ids` names, in order)."""
        for layer, (keys, values) in enumerate(kv):
            targets, subset = self.targets(layer, ids)
            if not targets.size:   # a windowed layer none of whose positions is held
                continue
            picked = rows if subset is None else (subset if rows is None else rows[subset])
            if picked is not None:
                keys, values = keys[picked], values[picked]
            self.write(layer, targets, keys, values)

    def targets(self, layer: int, ids: WriteIds) -> tuple[mx.array, mx.array | None]:
        """(the ids layer `layer` stores a write at, which of its n positions: None
        for all). Positions with window id 0 are left out of a windowed layer's
        scatter, so its row 0 stays zeros."""
        if self.windowed(layer):
            return ids.windows, ids.window_rows
        return ids.slots, None

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values `[heads, *slots.shape, dim]` at `slots`, as computed
        (dequantized)."""
        return (self.k_format.decode([a[:, slots] for a in self.keys[layer]]),
                self.v_format.decode([a[:, slots] for a in self.values[layer]]))

    def read_raw(self, layer: int, slots: mx.array) -> list[mx.array]:
        """The stored parts at `slots` (`[n, heads, ...]` each): the keys' parts, then
        the values'."""
        return [a[:, slots].swapaxes(0, 1) for a in self.keys[layer] + self.values[layer]]

    def raw_shapes(self, layer: int) -> list[tuple[tuple[int, ...], mx.Dtype]]:
        """Each stored part's shape past the row axis (`[heads, ...]`), and its dtype."""
        return [((a.shape[0], *a.shape[2:]), a.dtype)
                for a in self.keys[layer] + self.values[layer]]
