"""KV capacity from a memory limit, counting the pool and the live decode caches."""

import os

import mlx.core as mx

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


def kv_capacity_for(limit_bytes: int, weights_bytes: int, bytes_per_token: int,
                    ceiling: int) -> int:
    """Tokens of KV that fit: each token lives once in the pool and at most once
    more in a running request's decode cache, so it is counted twice."""
    free = limit_bytes - weights_bytes - ACTIVATION_RESERVE_BYTES
    capacity = min(free // (2 * bytes_per_token), ceiling)
    if capacity < 16:
        raise ValueError(
            f"memory limit of {limit_bytes / 1024**3:.2f} GiB leaves no room for a KV cache "
            f"(weights take {weights_bytes / 1024**3:.2f} GiB); raise --mem-fraction or "
            "--mem-limit-gb, or set --kv-capacity")
    return int(capacity)
