"""KV capacity from a memory limit, counting the pool, the window pool and the live
decode caches.

In pages the pool is the one KV store: running rows read it in place. The padded
layout's caches hold every running row's KV again, twice while a join copies them."""

import os
from dataclasses import dataclass

import mlx.core as mx

from mlxd.runtime.kv_layout import CACHE_STEP, decode_cache_budget

# Room for activations, logits and MLX's buffer cache beyond weights and KV.
ACTIVATION_RESERVE_BYTES = 512 * 1024 * 1024


def machine_memory_bytes() -> int:
    try:
        size = mx.device_info().get("memory_size", 0)
    except (AttributeError, RuntimeError):
        size = 0
    if size:
        return int(size)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit_bytes(mem_fraction: float, mem_limit_gb: float) -> int:
    if mem_limit_gb > 0:
        return int(mem_limit_gb * 1024**3)
    return int(mem_fraction * machine_memory_bytes())


@dataclass(frozen=True)
class KVBudget:
    capacity: int             # tokens in the slot pool
    decode_cache_tokens: int  # tokens the padded decode caches may span (kv_layout's
                              # rule; 0 in pages)
    window_capacity: int = 0  # window pool slots (0: no window pool)


@dataclass(frozen=True)
class WindowSplit:
    """A window pool's part of the split: the windowed layers' bytes per token, and
    its size for a KV pool of C tokens: every running request's window plus one
    step's prefill, twice over (the prefix tree keeps windows at reuse points), at
    most C; or `explicit` slots."""

    bytes_per_token: int
    window: int               # the largest sliding window
    max_prefill_tokens: int
    explicit: int = 0         # --window-capacity; 0: the rule

    def capacity(self, kv_capacity: int, max_running: int) -> int:
        if self.explicit:
            return self.explicit
        return min(kv_capacity, 2 * (max_running * self.window + self.max_prefill_tokens))


def window_split(geometry, max_context: int, max_prefill_tokens: int,
                 explicit: int = 0) -> WindowSplit | None:
    """The window pool's part of the split for a model of this `KVGeometry`, or None:
    its windowed layers then sit in the KV pool (it has none, or a window reaches
    as far as the context)."""
    if not 0 < geometry.max_window < max_context:
        return None
    return WindowSplit(geometry.bytes_per_window_token, geometry.max_window,
                       max_prefill_tokens, explicit)


def kv_budget(limit_bytes: int, weights_bytes: int, bytes_per_token: int,
              max_running: int, ceiling: int, capacity: int = 0,
              windows: WindowSplit | None = None, page: int = 0) -> KVBudget:
    """Split memory between the pool (C tokens) and the decode caches. In pages
    (`page` > 0) the pool is the one KV term. Padded (`page` 0): D tokens,
    kv_layout.decode_cache_budget(C), held `decode_cache_copies` times (twice while
    a join copies them): C + 2D fits. An explicit `capacity` sizes only the pool.
    With `windows` (padded only), `bytes_per_token` counts the global layers only
    and the window pool (its slots follow from C) and the decode caches' windowed
    layers are counted too."""
    if page:
        return _paged_budget(limit_bytes, weights_bytes, bytes_per_token, max_running,
                             ceiling, capacity, page)
    if windows is not None:
        return _window_budget(limit_bytes, weights_bytes, bytes_per_token, max_running,
                              ceiling, capacity, windows)
    if capacity:
        return KVBudget(capacity, decode_cache_budget(capacity, max_running))
    tokens = (limit_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES) // bytes_per_token
    pool = _pool_share(tokens, max_running, ceiling)
    _check_room(pool, limit_bytes, weights_bytes)
    return KVBudget(int(pool), decode_cache_budget(int(pool), max_running))


def _paged_budget(limit_bytes: int, weights_bytes: int, bytes_per_token: int,
                  max_running: int, ceiling: int, capacity: int, page: int) -> KVBudget:
    """One KV term: the pool C (whole pages, at most `ceiling`)."""
    if not capacity:
        tokens = (limit_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES) // bytes_per_token
        capacity = min(tokens, ceiling)
        _check_room(capacity, limit_bytes, weights_bytes)
    return KVBudget(max(page, capacity // page * page), 0)


def buffer_cache_bytes(page: int, decode_cache_tokens: int, bytes_per_token: int) -> int:
    """MLX's buffer cache limit: freed buffers are kept for reuse, since fresh memory
    costs a page fault per 4 KiB (a 64-row padded join took ~1.5 s on the CPU backend,
    whose cache limit starts at 0). Padded: joins and releases replace the decode
    caches' buffers, whose second copy the split already counts; that is the room.
    Pages: no decode cache; prefill's buffers come from the activation reserve."""
    if page:
        return ACTIVATION_RESERVE_BYTES
    return decode_cache_tokens * bytes_per_token


def _check_room(pool: int, limit_bytes: int, weights_bytes: int) -> None:
    if pool < 64:
        raise ValueError(
            f"memory limit of {limit_bytes / 1024**3:.2f} GiB leaves no room for a KV cache "
            f"(weights take {weights_bytes / 1024**3:.2f} GiB); raise --mem-fraction or "
            "--mem-limit-gb, or set --kv-capacity")


def _pool_share(tokens: int, max_running: int, ceiling: int) -> int:
    """A pool C <= ceiling with C + 2 x decode_cache_budget(C) <= tokens (padded)."""
    pool = min((tokens - 2 * CACHE_STEP) // 3, ceiling)   # first guess: D = C + a step
    if pool + 2 * decode_cache_budget(pool, max_running) > tokens:
        # small memory: a full batch of short rows comes first
        min_decode = decode_cache_budget(0, max_running)
        pool = min(tokens - 2 * min_decode, min_decode - 1, ceiling)
    return pool


def _window_budget(limit_bytes: int, weights_bytes: int, global_bytes: int,
                   max_running: int, ceiling: int, capacity: int,
                   windows: WindowSplit) -> KVBudget:
    """The largest C <= ceiling (or the explicit `capacity`) whose pool, window pool
    and decode caches (all their copies) fit; each grows with C, so a binary search
    finds it."""
    def cost(c: int) -> int:
        return (c * global_bytes + windows.capacity(c, max_running) * windows.bytes_per_token
                + 2 * decode_cache_budget(c, max_running)
                * (global_bytes + windows.bytes_per_token))

    if not capacity:
        room = limit_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES
        low, high = 0, ceiling
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if cost(mid) <= room else (low, mid - 1)
        capacity = low
        _check_room(capacity, limit_bytes, weights_bytes)
    return KVBudget(capacity, decode_cache_budget(capacity, max_running),
                    windows.capacity(capacity, max_running))
