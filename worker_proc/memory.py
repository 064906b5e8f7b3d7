"""KV capacity from a memory limit, counting the pool and the live decode caches."""

import os
from dataclasses import dataclass

import mlx.core as mx

# Room for activations, logits and MLX's buffer cache beyond weights and KV.
ACTIVATION_RESERVE_BYTES = 512 * 1024 * 1024
CACHE_STEP = 256   # mlx_lm's KV caches grow in steps of this many positions


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
    """Split memory between the pool (C tokens) and the decode caches (D tokens),
    which need twice their size while a join copies them: C + 2D fits. D is at
    least a full batch of short rows (max_running x 256). An explicit `capacity`
    sizes only the pool."""
    min_decode = max_running * CACHE_STEP
    if capacity:
        return KVBudget(capacity, max(cache_width(capacity + 1), min_decode))
    tokens = (limit_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES) // bytes_per_token
    pool = min((tokens - 2 * CACHE_STEP) // 3, ceiling)
    if pool + 2 * max(cache_width(pool + 1), min_decode) > tokens:
        # small memory: a full batch of short rows comes first
        pool = min(tokens - 2 * min_decode, min_decode - 1, ceiling)
    if pool < 64:
        raise ValueError(
            f"memory limit of {limit_bytes / 1024**3:.2f} GiB leaves no room for a KV cache "
            f"(weights take {weights_bytes / 1024**3:.2f} GiB); raise --mem-fraction or "
            "--mem-limit-gb, or set --kv-capacity")
    return KVBudget(int(pool), int(max(cache_width(pool + 1), min_decode)))


def cache_width(n: int) -> int:
    """Positions a KV cache holding `n` has: `n` rounded up to the cache step."""
    return -(-n // CACHE_STEP) * CACHE_STEP
