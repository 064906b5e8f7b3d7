"""The decode caches' layout rule (runtime/kv_layout.py), the one both processes use."""

import ast
from pathlib import Path

import pytest

from mlxd.runtime import kv_layout
from mlxd.runtime.kv_layout import (
    CACHE_STEP, batch_tokens, cache_width, decode_cache_budget, row_width,
)


@pytest.mark.parametrize("n, width", [(0, 0), (1, 256), (255, 256), (256, 256),
                                      (257, 512), (1000, 1024)])
def test_cache_width_rounds_up_to_the_step(n, width):
    assert cache_width(n) == width


@pytest.mark.parametrize("n, width", [(1, 256), (254, 256), (255, 512), (256, 512),
                                      (510, 512), (511, 768)])
def test_a_row_has_room_for_the_next_input_and_a_chained_position(n, width):
    assert row_width(n) == width
    assert row_width(n) >= n + 2 and row_width(n) % CACHE_STEP == 0


def test_a_batch_is_as_wide_as_its_longest_row():
    assert batch_tokens([]) == 0
    assert batch_tokens([5]) == 256
    assert batch_tokens([5, 300, 40]) == 3 * 512
    assert batch_tokens([300, 5, 40]) == batch_tokens([5, 40, 300])
    assert batch_tokens([254] * 4) == 4 * 256 and batch_tokens([255] * 4) == 4 * 512


@pytest.mark.parametrize("capacity", [64, 254, 255, 256, 1000, 4096])
@pytest.mark.parametrize("max_running", [1, 4, 64])
def test_the_decode_budget_fits_the_longest_row_or_a_full_batch_of_short_rows(
        capacity, max_running):
    """The smallest budget holding both a row whose KV and next input's slot fill the
    pool, and `max_running` one-token rows."""
    budget = decode_cache_budget(capacity, max_running)
    longest = batch_tokens([capacity - 1])
    full_batch = batch_tokens([1] * max_running)
    assert budget == max(longest, full_batch)


def test_the_rule_imports_nothing_but_the_standard_library():
    """The scheduler imports it: no MLX, no ZeroMQ, nothing of either process."""
    tree = ast.parse(Path(kv_layout.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {m.split(".")[0] for m in modules} <= {"collections", "typing", "math"}
