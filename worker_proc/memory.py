"""KV capacity from a memory limit, counting the pool and the live decode caches."""

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
    decode_cache_tokens: int  # tokens the padded decode caches may span (rows x width)


def kv_budget(limit_bytes: int, weights_bytes: int, bytes_per_token: int,
              max_running: int, ceiling: int, capacity: int = 0) -> KVBudget:
    """Split memory between the pool (C tokens) and the decode caches (D tokens, the
    scheduler's budget for C: kv_layout.decode_cache_budget), which need twice their
    size while a join copies them: C + 2D fits. An explicit `capacity` sizes only
    the pool."""
    if capacity:
        return KVBudget(capacity, decode_cache_budget(capacity, max_running))
    tokens = (limit_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES) // bytes_per_token
    pool = _pool_share(tokens, max_running, ceiling)
    if pool < 64:
        raise ValueError(
            f"memory limit of {limit_bytes / 1024**3:.2f} GiB leaves no room for a KV cache "
            f"(weights take {weights_bytes / 1024**3:.2f} GiB); raise --mem-fraction or "
            "--mem-limit-gb, or set --kv-capacity")
    return KVBudget(int(pool), decode_cache_budget(int(pool), max_running))


def _pool_share(tokens: int, max_running: int, ceiling: int) -> int:
    """A pool C <= ceiling with C + 2 * decode_cache_budget(C) <= tokens."""
    pool = min((tokens - 2 * CACHE_STEP) // 3, ceiling)   # first guess: D = C + a step
    if pool + 2 * decode_cache_budget(pool, max_running) > tokens:
        # small memory: a full batch of short rows comes first
        min_decode = decode_cache_budget(0, max_running)
        pool = min(tokens - 2 * min_decode, min_decode - 1, ceiling)
    return pool
