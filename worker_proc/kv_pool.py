"""The slot-indexed KV pool. The scheduler books slot ids; this stores what they hold.

Per layer, keys and values are `[capacity + 1, n_kv_heads, head_dim]`; slot 0 is
padding and never handed out. Writes are scatters at the slot ids the scheduler
sent; MLX donates the pool buffer, so a write costs the rows written, not the pool.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.n_kv_heads * (self.k_head_dim + self.v_head_dim)
        return self.num_layers * per_layer * self.dtype.size


class KVPool:
    def __init__(self, geometry: KVGeometry, capacity: int):
        g = geometry
        self.geometry = g
        self.capacity = capacity
        self.keys = [mx.zeros((capacity + 1, g.n_kv_heads, g.k_head_dim), g.dtype)
                     for _ in range(g.num_layers)]
        self.values = [mx.zeros((capacity + 1, g.n_kv_heads, g.v_head_dim), g.dtype)
                       for _ in range(g.num_layers)]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def check_slots(self, slot_ids: list[int]) -> None:
        if slot_ids and (min(slot_ids) < 1 or max(slot_ids) > self.capacity):
            raise ValueError(f"slot id outside 1..{self.capacity}")

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store `[n, heads, dim]` keys/values at `slots` (an int32 array of n ids)."""
        self.keys[layer][slots] = keys
        self.values[layer][slots] = values

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        return self.keys[layer][slots], self.values[layer][slots]
