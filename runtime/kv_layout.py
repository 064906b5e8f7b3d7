"""The KV layout rules the scheduler and the worker share. Pure: no MLX.

The worker decodes its running requests as one batch, in one of two layouts,
named by a page size the worker reports (`WorkerLimits.decode_page`):

- paged (page > 0, DECODE_PAGE by default): the pool itself is in pages of `page`
  positions; the scheduler books whole pages (scheduler_proc/allocator.py) and the
  decode reads each row's KV where the pool holds it (worker_proc/paged_batch.py).
  Nothing else holds a running row's KV, so there is no decode budget to share.
- padded (page 0): mlx_lm's left-padded batch caches hold every running row's KV
  again, every row as wide as the widest, buffers growing in CACHE_STEP positions;
  a join copies the whole batch, so the caches need room for two copies. Used for
  models whose attention does not go through the paged hook. The scheduler budgets
  them with `batch_tokens` and `decode_cache_budget`; the worker sizes its memory
  split with the same functions.
"""

from collections.abc import Sequence

CACHE_STEP = 256    # mlx_lm's KV caches grow in steps of this many positions
ROW_ROOM = 2        # beyond a row's KV: the next input's position, and a chained one
DECODE_PAGE = 64    # positions per page of the pool (docs/PERFORMANCE.md: the knee)
KV_GROUPS = (32, 64, 128)   # values per scale and bias --kv-group-size takes
KV_GROUP = 32   # and by default: the best agreement (worker_proc/kv_quant.py)


def cache_width(n: int) -> int:
    """Positions a cache buffer holding `n` positions has: `n` rounded up to the step."""
    return -(-n // CACHE_STEP) * CACHE_STEP


def row_width(n: int) -> int:
    """The width the padded decode caches need for a longest row holding `n` KV
    positions."""
    return cache_width(n + ROW_ROOM)


def batch_tokens(lengths: Sequence[int]) -> int:
    """Tokens the padded decode caches span for rows holding `lengths` KV positions;
    0 for no rows."""
    if not lengths:
        return 0
    return len(lengths) * row_width(max(lengths))


def decode_cache_budget(kv_capacity: int, max_running: int) -> int:
    """Tokens the padded decode caches may span: a row as long as the pool allows
    (its KV and the next input's slot fill the pool), or a full batch of one-token
    rows."""
    return max(row_width(kv_capacity - 1), max_running * row_width(1))
