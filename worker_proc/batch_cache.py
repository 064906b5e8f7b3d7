"""The batched KV caches: the worker's one module that touches mlx_lm's cache objects.

A batch's KV lives in one cache per layer, rows left-padded so that every row
ends at the same column (mlx_lm's `BatchKVCache`; its private `_idx`,
`left_padding` and `offset` are read and written here only). The rest of the
worker speaks this interface: prefill caches for given left pads, prefixes
loaded into them, rows of several caches merged into one decode cache with room,
the newest position's KV, size and width.

Models whose layers are not all plain KV caches are described by a `CacheLayout`,
discovered from the model's own `make_cache()`: per layer a KV cache, a
sliding-window one (served as a full KV cache whose mask the model limits to the
window; its KV sits in the pool, or in the window pool: kv_pool), a recurrent state
(`ArraysCache`, one row per request) or a `CacheList` of those. Its KV leaves are
the pool's layers, in order; its state leaves the state pool's.

Merging copies every row once into a buffer as wide as kv_layout's rule says. mlx_lm's
`BatchKVCache.extend` pads each part, then concatenates, and the next decode then
often grows the full buffer: three copies of the whole batch's KV for every join,
which dominated serving time under steady arrivals.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache, BatchKVCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache,
)

from mlxd.runtime.kv_layout import CACHE_STEP, row_width

LayerCache = BatchKVCache   # one layer's cache of a batch of rows


class DecodeKVCache(BatchKVCache):
    """mlx_lm's batch cache that also keeps the keys/values of the latest update:
    the decoded positions' KV, for the pool, without reading the cache buffer
    (a pending read of it would stop the next update from reusing the buffer)."""

    step = CACHE_STEP   # a decode grows the buffer as kv_layout's rule counts
    newest: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys, values):
        self.newest = (keys, values)
        return super().update_and_fetch(keys, values)


# ---- prefill --------------------------------------------------------------

def prefill_caches(num_layers: int, left_pads: list[int]) -> list[LayerCache]:
    """Empty caches, one per layer, for rows whose tokens start after `left_pads[i]`
    padding positions (every row's tokens end at the same column)."""
    return [BatchKVCache(left_pads) for _ in range(num_layers)]


def load_prefix(cache: LayerCache, keys: mx.array, values: mx.array, prefix_len: int) -> None:
    """Give an empty prefill cache its rows' cached prefixes: `keys`/`values`
    `[rows, heads, width, dim]` hold every row's prefix right-aligned to column
    `prefix_len` (after its left padding), then room for the new tokens. The cache
    takes the buffers as its own: the forward writes the new tokens in place."""
    cache.state = (keys, values, cache.offset + prefix_len, cache.left_padding, prefix_len)


def last_positions(cache: LayerCache, n: int) -> tuple[mx.array, mx.array]:
    """Keys/values `[rows, heads, n, dim]` of the `n` columns before the rows' end."""
    end = cache.size()
    return cache.keys[:, :, end - n:end, :], cache.values[:, :, end - n:end, :]


def cache_arrays(caches: list) -> list:
    """What to evaluate to compute everything written into `caches`."""
    arrays = []
    for c in _leaves(caches):
        if isinstance(c, ArraysCache):
            arrays += [a for a in c.cache if a is not None]
        elif c.keys is not None:
            arrays += [c.keys, c.values]
    return arrays


# ---- decode ---------------------------------------------------------------

def merge(parts: list[tuple[LayerCache, mx.array | None]]) -> DecodeKVCache:
    """One decode cache with the rows of the parts (a cache, and which of its rows
    to take: None for all), in order, right-aligned at the longest row's end, in a
    buffer `kv_layout.row_width(longest row)` wide: room for the next position and
    a chained one. Every row is copied once."""
    pieces = [_piece(cache, rows) for cache, rows in parts]
    end = max(c._idx - start for c, _, _, _, start in pieces)
    ref = next(c for c, *_ in pieces if c.keys is not None)
    _, heads, _, k_dim = ref.keys.shape
    n_rows = sum(offset.shape[0] for _, _, _, offset, _ in pieces)
    width = row_width(end)
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


def _piece(cache: LayerCache, rows: mx.array | None) -> tuple:
    """(cache, rows, their left padding, their offsets, the first column they use)."""
    left = cache.left_padding if rows is None else cache.left_padding[rows]
    offset = cache.offset if rows is None else cache.offset[rows]
    start = int(mx.min(left).item()) if cache.keys is not None else cache._idx
    return cache, rows, left, offset, start


def keep_rows(cache: LayerCache, rows: mx.array) -> None:
    """Drop every row of the cache but `rows` (in place; a copy of those rows)."""
    cache.filter(rows)


def newest_kv(cache: DecodeKVCache) -> tuple[mx.array, mx.array]:
    """Keys/values `[rows, heads, dim]` of the position the last forward wrote."""
    keys, values = cache.newest
    return keys[:, :, -1, :], values[:, :, -1, :]


def size(cache: LayerCache) -> int:
    """Positions the rows' common end is at: the longest row's KV length."""
    return cache.size()


def width(cache: LayerCache) -> int:
    """Positions the cache's buffer has (0 while empty)."""
    return 0 if cache.keys is None else cache.keys.shape[2]


def is_full(cache: LayerCache) -> bool:
    """The next decode position does not fit: writing it grows (copies) the buffer."""
    return size(cache) >= width(cache)


def span(cache: LayerCache) -> int:
    """Tokens the cache's buffer spans: rows x width (what the decode budget counts)."""
    return cache.offset.shape[0] * width(cache)


# ---- the model's caches ---------------------------------------------------

KV, STATE = "kv", "state"   # a layout's leaf kinds


class UnsupportedCache(ValueError):
    """The model uses a cache kind the worker cannot serve (named in the message)."""


@dataclass(frozen=True)
class CacheLayout:
    """What the model's `make_cache()` holds per layer: "kv", ("state", n arrays) or
    a tuple of those (a CacheList). `windows[i]` is the sliding window of the i-th
    KV leaf (0: global attention)."""

    layers: tuple
    windows: tuple[int, ...]

    @classmethod
    def all_kv(cls, num_layers: int) -> "CacheLayout":
        return cls((KV,) * num_layers, (0,) * num_layers)

    @property
    def plain(self) -> bool:
        """Every layer is one global KV cache: the caches are the pool's layers."""
        return all(kind == KV for kind in self.layers) and not any(self.windows)

    @property
    def num_kv(self) -> int:
        return len(self.windows)

    @property
    def has_state(self) -> bool:
        return any(kind != KV for kind in _flat(self.layers))


def describe(model) -> CacheLayout:
    """The layout of the model's caches; UnsupportedCache for a kind not served."""
    windows: list[int] = []
    layers = tuple(_describe(c, windows) for c in make_prompt_cache(model))
    return CacheLayout(layers, tuple(windows))


def _describe(cache, windows: list[int]):
    kind = type(cache)
    if kind is KVCache:
        windows.append(0)
        return KV
    if kind is RotatingKVCache:
        if cache.keep:   # the first `keep` positions would stay visible beyond the window
            raise UnsupportedCache(f"RotatingKVCache with keep={cache.keep}")
        windows.append(cache.max_size)
        return KV
    if issubclass(kind, ArraysCache):
        return (STATE, len(cache.cache))
    if kind is CacheList:
        return tuple(_describe(c, windows) for c in cache.caches)
    raise UnsupportedCache(f"{kind.__name__}")


def _flat(layers):
    for kind in layers:
        if isinstance(kind, tuple) and kind and kind[0] != STATE:
            yield from _flat(kind)
        else:
            yield kind


def model_caches(layout: CacheLayout, left_pads: list[int], token_pads: list[int]) -> list:
    """Empty prefill caches shaped as the model's own: KV caches for rows after
    `left_pads` columns (a shorter cached prefix is padded too), state caches for
    rows whose input starts after `token_pads` tokens. A recurrent layer masks
    its input by its padding, so it must count the padding tokens of this input
    only, never a prefix's: that state was stored, not recomputed."""
    if all(kind == KV for kind in layout.layers):
        return prefill_caches(len(layout.layers), left_pads)
    return [_empty(kind, left_pads, token_pads) for kind in layout.layers]


def _empty(kind, left_pads: list[int], token_pads: list[int]):
    if kind == KV:
        return BatchKVCache(left_pads)
    if kind[0] == STATE:
        return ArraysCache(kind[1], left_padding=token_pads)
    return CacheList(*(_empty(k, left_pads, token_pads) for k in kind))


def kv_leaves(layout: CacheLayout, caches: list) -> list[LayerCache]:
    """The KV caches among a model's caches, in pool layer order."""
    return caches if layout.plain else [c for c in _leaves(caches) if isinstance(c, BatchKVCache)]


def state_leaves(layout: CacheLayout, caches: list) -> list:
    """The recurrent-state caches among a model's caches, in state pool order."""
    return [] if layout.plain else [c for c in _leaves(caches) if isinstance(c, ArraysCache)]


def _leaves(caches):
    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(c.caches)
        else:
            yield c


def load_state(cache, arrays: list[mx.array]) -> None:
    """Give an empty prefill state cache its rows' starting state (`[rows, ...]` each)."""
    cache.cache = list(arrays)


def state_arrays(cache) -> list[mx.array]:
    """A state cache's arrays, `[rows, ...]` each, after its forward."""
    return list(cache.cache)


def merge_layer(parts: list[tuple]) -> object:
    """`merge` for any layer kind: KV caches as `merge` does, states by row, lists by
    member."""
    first = parts[0][0]
    if isinstance(first, BatchKVCache):
        return merge(parts)
    if isinstance(first, CacheList):
        return CacheList(*(merge_layer([(c.caches[i], rows) for c, rows in parts])
                           for i in range(len(first.caches))))
    return _merge_states(parts)


def _merge_states(parts: list[tuple]) -> ArraysCache:
    """Rows of state caches, in order (no padding: a decode row's state is its own)."""
    merged = ArraysCache(len(parts[0][0].cache))
    for i in range(len(merged.cache)):
        pieces = [c.cache[i] if rows is None else c.cache[i][rows] for c, rows in parts]
        merged.cache[i] = mx.concatenate(pieces)
    return merged


# ---- rows leaving a prefill for the decode pages ---------------------------

def row_extents(cache: LayerCache) -> tuple[list[int], int]:
    """A prefill KV cache's rows: (each row's first column, the rows' common end);
    row i holds columns [first[i], end)."""
    if cache.keys is None:
        return [0] * cache.offset.shape[0], 0
    return cache.left_padding.tolist(), cache._idx


def row_columns(cache: LayerCache, row: int, start: int, stop: int) -> tuple[mx.array, mx.array]:
    """Keys/values `[heads, stop - start, dim]` of one row's columns start .. stop - 1."""
    return cache.keys[row, :, start:stop], cache.values[row, :, start:stop]


def assemble(layout: CacheLayout, kv: list, states: list[list[mx.array]],
             lengths: list[int] | None = None) -> tuple[list, list]:
    """The model's caches in its own structure from given KV leaves (in pool order)
    and per state leaf its rows' arrays: (caches, the state caches made, in state
    order; a forward updates their arrays). `lengths`: each row's real inputs, the
    rest right padding the recurrent layers leave out of their states (mlx_lm's
    batch `lengths`)."""
    kv_iter, state_iter, made = iter(kv), iter(states), []

    def build(kind):
        if kind == KV:
            return next(kv_iter)
        if kind[0] == STATE:
            cache = ArraysCache(kind[1])
            load_state(cache, next(state_iter))
            if lengths is not None:
                cache.prepare(lengths=lengths)
            made.append(cache)
            return cache
        return CacheList(*(build(k) for k in kind))

    return [build(kind) for kind in layout.layers], made


def one_token_caches(model) -> tuple[list, list]:
    """Run one token through the model. Per KV leaf, keys/values `[1, heads,
    positions, dim]`; per state leaf, its arrays `[1, ...]` (evaluated)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    kv, states = [], []
    for c in _leaves(cache):
        if isinstance(c, ArraysCache):
            states.append(list(c.cache))
        else:
            kv.append((c.keys, c.values))
    return kv, states

