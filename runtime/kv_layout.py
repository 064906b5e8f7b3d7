"""The decode caches' layout rule, shared by the scheduler and the worker.

The worker decodes its running requests as one batch whose caches are padded:
every row is as wide as the widest, buffers grow in CACHE_STEP positions, and a
row holds its KV, the next input's position and, with overlap, one chained
position (its KV length + ROW_ROOM, rounded up to the step). The scheduler
budgets memory with `batch_tokens` and `decode_cache_budget`; the worker sizes
its memory split and its joined caches with the same functions. Pure: no MLX.

This rule belongs to the padded layout. A decode that attends over each row's
own KV (no padding) replaces it: change the functions here, and the scheduler's
budget and the worker's memory split follow from this one place.
"""

from collections.abc import Sequence

CACHE_STEP = 256   # mlx_lm's KV caches grow in steps of this many positions
ROW_ROOM = 2       # beyond a row's KV: the next input's position, and a chained one


def cache_width(n: int) -> int:
    """Positions a cache buffer holding `n` positions has: `n` rounded up to the step."""
    return -(-n // CACHE_STEP) * CACHE_STEP


def row_width(n: int) -> int:
    """The width the decode caches need for a longest row holding `n` KV positions."""
    return cache_width(n + ROW_ROOM)


def batch_tokens(lengths: Sequence[int]) -> int:
    """Tokens the padded decode caches span for rows holding `lengths` KV positions
    (every row as wide as the longest needs); 0 for no rows."""
    return len(lengths) * row_width(max(lengths)) if lengths else 0


def decode_cache_budget(kv_capacity: int, max_running: int) -> int:
    """Tokens the decode caches may span: a row as long as the pool allows (its KV
    and the next input's slot fill the pool), or a full batch of one-token rows."""
    return max(row_width(kv_capacity - 1), max_running * row_width(1))
