"""memory.kv_budget: the split of memory between the KV pool, the window pool and the
decode caches (pure arithmetic, no model)."""

from dataclasses import astuple

import pytest

import mlx.core as mx

from mlxd.runtime.kv_layout import decode_cache_budget
from mlxd.worker_proc.batch_cache import KV, CacheLayout
from mlxd.worker_proc.kv_pool import KVGeometry
from mlxd.worker_proc.memory import (
    ACTIVATION_RESERVE_BYTES, WindowSplit, kv_budget, window_split,
)

GiB = 1024**3
RESERVE = ACTIVATION_RESERVE_BYTES


@pytest.mark.parametrize("args, capacity, decode_tokens", [
    ((8 * GiB, GiB, 4096, 64, 64 * 4096), 262144, 262400),     # the ceiling
    ((2 * GiB, GiB, 36864, 8, 8 * 2048), 4683, 4864),
    ((600 * 1024**2, 0, 1000, 64, 10**9), 30587, 30720),
    ((RESERVE + 3000 * 100, 0, 100, 4, 10**9), 829, 1024),
    ((RESERVE + 40000 * 100, 0, 100, 64, 10**9), 7232, 16384),  # a batch of short rows first
])
def test_without_windows_the_split_is_unchanged(args, capacity, decode_tokens):
    """The results the split gave before window pools existed."""
    assert astuple(kv_budget(*args)) == (capacity, decode_tokens, 0)
    assert kv_budget(*args[:4], ceiling=10**9, capacity=5000).capacity == 5000


def window_cost(c: int, cw: int, global_bytes: int, split: WindowSplit, running: int) -> int:
    return (c * global_bytes + cw * split.bytes_per_token
            + 2 * decode_cache_budget(c, running) * (global_bytes + split.bytes_per_token))


@pytest.mark.parametrize("limit, running, prefill", [
    (2 * GiB, 64, 4096), (GiB, 8, 512), (RESERVE + 20 * 1024**2, 4, 64), (40 * GiB, 256, 8192),
])
def test_with_windows_the_budget_holds_and_the_window_pool_follows_the_rule(limit, running,
                                                                            prefill):
    split = WindowSplit(bytes_per_token=1000, window=512, max_prefill_tokens=prefill)
    global_bytes, ceiling = 3000, running * 32768
    budget = kv_budget(limit, 0, global_bytes, running, ceiling, windows=split)
    c, cw = budget.capacity, budget.window_capacity
    assert cw == min(c, 2 * (running * 512 + prefill))
    assert budget.decode_cache_tokens == decode_cache_budget(c, running)
    room = limit - RESERVE
    assert window_cost(c, cw, global_bytes, split, running) <= room
    if c < ceiling:   # the largest pool that fits
        grown = c + 1
        assert window_cost(grown, split.capacity(grown, running), global_bytes, split,
                           running) > room


def test_a_window_pool_leaves_room_for_a_larger_kv_pool():
    """Counting windowed layers per window slot instead of per token grows the pool."""
    split = WindowSplit(bytes_per_token=2000, window=128, max_prefill_tokens=512)
    with_windows = kv_budget(4 * GiB, 0, 2000, 16, 10**9, windows=split)
    all_global = kv_budget(4 * GiB, 0, 4000, 16, 10**9)
    assert with_windows.capacity > all_global.capacity
    assert with_windows.window_capacity == 2 * (16 * 128 + 512)


def test_explicit_capacities():
    """--kv-capacity sets C (the window pool then follows the rule); --window-capacity
    sets the window pool."""
    rule = WindowSplit(bytes_per_token=100, window=64, max_prefill_tokens=256)
    assert astuple(kv_budget(0, 0, 100, 8, 10**9, capacity=5000, windows=rule)) == (
        5000, decode_cache_budget(5000, 8), 2 * (8 * 64 + 256))
    assert kv_budget(0, 0, 100, 8, 10**9, capacity=300, windows=rule).window_capacity == 300
    fixed = WindowSplit(bytes_per_token=100, window=64, max_prefill_tokens=256, explicit=77)
    budget = kv_budget(GiB, 0, 100, 8, 10**9, windows=fixed)
    assert budget.window_capacity == 77
    assert window_cost(budget.capacity, 77, 100, fixed, 8) <= GiB - RESERVE


def test_too_little_memory_is_refused_with_windows():
    split = WindowSplit(bytes_per_token=1000, window=512, max_prefill_tokens=4096)
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_budget(RESERVE + 10**6, 0, 3000, 64, 10**9, windows=split)


def geometry(windows: tuple[int, ...]) -> KVGeometry:
    layout = CacheLayout((KV,) * len(windows), windows)
    return KVGeometry(len(windows), 2, 16, 16, mx.float16,
                      None if layout.plain else layout)


def test_a_window_pool_only_for_windows_shorter_than_the_context():
    split = window_split(geometry((0, 512, 0, 256)), 4096, 2048, explicit=9)
    assert split == WindowSplit(2 * 2 * 32 * 2, 512, 2048, 9)   # two windowed layers
    assert geometry((0, 512, 0, 256)).bytes_per_token == 2 * split.bytes_per_token
    assert window_split(geometry((0, 4096)), 4096, 2048) is None
    assert window_split(geometry((0, 0)), 4096, 2048) is None
