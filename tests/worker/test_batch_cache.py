"""worker_proc/batch_cache.py: the one module that touches mlx_lm's cache objects."""

import re
from pathlib import Path

import mlx.core as mx
import pytest

from mlxd import worker_proc
from mlxd.runtime.kv_layout import row_width
from mlxd.worker_proc import batch_cache

HEADS, DIM = 2, 4

# mlx_lm's cache classes and factory, and the private state batch_cache manages
MLX_LM_CACHE_INTERNALS = re.compile(
    r"mlx_lm\.models\.cache|mlx_lm\.models import cache|\w*KVCache\b|make_prompt_cache"
    r"|\._idx\b|\bleft_padding\b|\.state\s*=(?!=)|\.filter\(")


def test_no_other_worker_module_touches_mlx_lm_cache_internals():
    folder = Path(worker_proc.__file__).parent
    offenders = {}
    for path in sorted(folder.glob("*.py")):
        if path.name == "batch_cache.py":
            continue
        hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                if MLX_LM_CACHE_INTERNALS.search(line)]
        if hits:
            offenders[path.name] = hits
    assert len(list(folder.glob("*.py"))) > 5   # the scan found the worker's modules
    assert not offenders, f"mlx_lm cache internals outside batch_cache.py: {offenders}"


@pytest.mark.parametrize("line", [
    "from mlx_lm.models.cache import BatchKVCache", "c = KVCache()",
    "class DecodeKVCache(x):", "cache = make_prompt_cache(model)", "end = cache._idx",
    "pads = c.left_padding", "cache.state = (k, v)"])
def test_the_scan_recognises_each_internal(line):
    assert MLX_LM_CACHE_INTERNALS.search(line)


@pytest.mark.parametrize("line", [
    "sampled_idx = [1]", "x = cache.state", "if c.state == s:", "left-padded rows"])
def test_the_scan_leaves_ordinary_code_alone(line):
    assert not MLX_LM_CACHE_INTERNALS.search(line)


def _prefilled(lengths: list[int], fill: float = 0.0) -> list:
    """One layer's prefill cache holding rows of `lengths` tokens; the keys of row i
    at its position j are fill + 100 i + j (values: the negatives)."""
    width = max(lengths)
    [cache] = batch_cache.prefill_caches(1, [width - n for n in lengths])
    k = mx.array([[fill + 100 * i + j for j in range(-width + n, n)]
                  for i, n in enumerate(lengths)], mx.float32)
    k = mx.broadcast_to(k[:, None, :, None], (len(lengths), HEADS, width, DIM))
    cache.update_and_fetch(k, -k)
    return cache


def _row(cache, i: int) -> list[float]:
    """Row i's keys (head 0, dim 0) from its first position to the rows' end."""
    keys, _ = batch_cache.last_positions(cache, batch_cache.size(cache))
    left = int(cache.left_padding[i].item())   # the test may look inside
    return keys[i, 0, left:, 0].tolist()


def test_merge_right_aligns_every_row_in_a_buffer_as_wide_as_the_rule():
    a, b = _prefilled([3, 7]), _prefilled([5], fill=1000)
    merged = batch_cache.merge([(a, None), (b, None)])
    assert batch_cache.size(merged) == 7
    assert batch_cache.width(merged) == row_width(7)
    assert batch_cache.span(merged) == 3 * row_width(7)
    assert _row(merged, 0) == [0, 1, 2]
    assert _row(merged, 1) == [100 + j for j in range(7)]
    assert _row(merged, 2) == [1000 + j for j in range(5)]


def test_merge_takes_the_chosen_rows_only():
    a = _prefilled([3, 9, 4])
    merged = batch_cache.merge([(a, mx.array([0, 2]))])
    assert batch_cache.size(merged) == 4 and batch_cache.span(merged) == 2 * row_width(4)
    assert _row(merged, 0) == [0, 1, 2] and _row(merged, 1) == [200 + j for j in range(4)]


def test_a_decode_writes_the_next_position_and_keeps_its_kv():
    merged = batch_cache.merge([(_prefilled([2, 5]), None)])
    new = mx.full((2, HEADS, 1, DIM), 7.0)
    merged.update_and_fetch(new, -new)
    keys, values = batch_cache.newest_kv(merged)
    assert keys.shape == (2, HEADS, DIM) and mx.all(keys == 7).item()
    assert mx.all(values == -7).item()
    assert _row(merged, 0) == [0, 1, 7] and batch_cache.size(merged) == 6
    assert batch_cache.width(merged) == row_width(5)   # the position fit the room


def test_a_cache_is_full_when_the_next_position_would_grow_it():
    merged = batch_cache.merge([(_prefilled([2, 5]), None)])
    new = mx.zeros((2, HEADS, 1, DIM))
    for _ in range(batch_cache.width(merged) - 5):
        assert not batch_cache.is_full(merged)
        merged.update_and_fetch(new, new)
    assert batch_cache.is_full(merged)
    merged.update_and_fetch(new, new)
    assert batch_cache.width(merged) == 2 * row_width(5) and not batch_cache.is_full(merged)


def test_a_loaded_prefix_is_extended_in_place():
    """Rows with prefixes of 2 and 4 positions (right-aligned) and room for 3 new ones."""
    [cache] = batch_cache.prefill_caches(1, [2, 0])
    prefix = mx.array([[0, 0, 10, 11, 0, 0, 0], [20, 21, 22, 23, 0, 0, 0]], mx.float32)
    prefix = mx.broadcast_to(prefix[:, None, :, None], (2, HEADS, 7, DIM))
    batch_cache.load_prefix(cache, prefix, -prefix, 4)
    new = mx.broadcast_to(mx.array([[1.0, 2, 3], [4, 5, 6]])[:, None, :, None], (2, HEADS, 3, DIM))
    cache.update_and_fetch(new, -new)
    assert batch_cache.width(cache) == 7   # written in place: no growth
    assert _row(cache, 0) == [10, 11, 1, 2, 3]
    assert _row(cache, 1) == [20, 21, 22, 23, 4, 5, 6]
    keys, values = batch_cache.last_positions(cache, 3)
    assert keys[:, 0, :, 0].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert values[:, 0, :, 0].tolist() == [[-1, -2, -3], [-4, -5, -6]]


def test_keep_rows_drops_the_others():
    cache = _prefilled([3, 9, 4])
    batch_cache.keep_rows(cache, mx.array([0, 2]))
    assert batch_cache.span(cache) == 2 * batch_cache.width(cache)
    assert _row(cache, 0) == [0, 1, 2] and _row(cache, 1) == [200 + j for j in range(4)]


# ---- the model's cache layout -------------------------------------------------------

class _FakeModel:
    """A model whose make_cache() returns the given caches (describe reads only that)."""

    def __init__(self, make):
        self.make_cache = make


def test_the_layout_is_read_from_make_cache():
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    layout = batch_cache.describe(_FakeModel(lambda: [
        RotatingKVCache(max_size=16), KVCache(), ArraysCache(2),
        CacheList(ArraysCache(1), KVCache())]))
    assert layout.layers == ("kv", "kv", ("state", 2), (("state", 1), "kv"))
    assert layout.windows == (16, 0, 0) and layout.num_kv == 3
    assert layout.has_state and not layout.plain
    assert batch_cache.describe(_FakeModel(lambda: [KVCache(), KVCache()])).plain


@pytest.mark.parametrize("make,name", [
    (lambda c: c.QuantizedKVCache(), "QuantizedKVCache"),
    (lambda c: c.ChunkedKVCache(8), "ChunkedKVCache"),
    (lambda c: c.RotatingKVCache(max_size=8, keep=4), "RotatingKVCache with keep=4")])
def test_a_cache_kind_not_served_is_named(make, name):
    from mlx_lm.models import cache
    from mlxd.worker_proc.model_runner import UnsupportedModel, probe_geometry

    model = _FakeModel(lambda: [cache.KVCache(), make(cache)])
    with pytest.raises(batch_cache.UnsupportedCache, match=name):
        batch_cache.describe(model)
    with pytest.raises(UnsupportedModel, match=name):
        probe_geometry(model)
