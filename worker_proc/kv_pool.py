"""The slot-indexed KV pool. The scheduler books slot ids; this stores what they hold.

Per layer, keys and values are `[capacity + 1, n_kv_heads, head_dim]`; slot 0 is
padding and never handed out. Writes are scatters at the slot ids the scheduler
sent; MLX donates the pool buffer, so a write costs the rows written, not the pool.

Models with recurrent layers also get a `StatePool`: per state array,
`[state_slots + 1, ...]`, one slot per request's state (slot 0: the zero state,
never written). Its slot ids are booked by the scheduler too.
"""

from dataclasses import dataclass

import mlx.core as mx

from .batch_cache import CacheLayout


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

    @property
    def cache_layout(self) -> CacheLayout:
        return self.layout or CacheLayout.all_kv(self.num_layers)

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.n_kv_heads * (self.k_head_dim + self.v_head_dim)
        return self.num_layers * per_layer * self.dtype.size

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


class KVPool:
    def __init__(self, geometry: KVGeometry, capacity: int, state_slots: int = 0):
        g = geometry
        self.geometry = g
        self.capacity = capacity
        self.keys = [mx.zeros((capacity + 1, g.n_kv_heads, g.k_head_dim), g.dtype)
                     for _ in range(g.num_layers)]
        self.values = [mx.zeros((capacity + 1, g.n_kv_heads, g.v_head_dim), g.dtype)
                       for _ in range(g.num_layers)]
        self.states = StatePool(g, state_slots) if g.state_shapes else None
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def arrays(self) -> list:
        """Everything a step's writes change (evaluated with the step)."""
        if self.states is None:
            return [self.keys, self.values]
        return [self.keys, self.values, self.states.arrays]

    def check_slots(self, slot_ids: list[int]) -> None:
        if slot_ids and (min(slot_ids) < 1 or max(slot_ids) > self.capacity):
            raise ValueError(f"slot id outside 1..{self.capacity}")

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store `[n, heads, dim]` keys/values at `slots` (an int32 array of n ids)."""
        self.keys[layer][slots] = keys
        self.values[layer][slots] = values

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        return self.keys[layer][slots], self.values[layer][slots]
