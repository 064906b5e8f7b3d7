"""The decode caches' layout rule, shared by the scheduler and the worker.

The worker decodes its running requests as one batch, in one of two layouts,
named by a page size the worker reports (`WorkerLimits.decode_page`):

- paged (page > 0, DECODE_PAGE by default): each row's KV in pages of `page`
  positions, attended in place (worker_proc/decode_pages). A row holds its KV, the
  next input's position and, with overlap, one chained position (ROW_ROOM),
  rounded up to whole pages; the batch spans the sum of its rows. Joins write only
  the joining rows, so the pages need no second copy.
- padded (page 0): mlx_lm's left-padded batch caches, every row as wide as the
  widest, buffers growing in CACHE_STEP positions; a join copies the whole batch,
  so the caches need room for two copies. Used for models whose attention does not
  go through the paged hook.

The scheduler budgets with `batch_tokens` and `decode_cache_budget`; the worker
sizes its memory split and its caches with the same functions. Pure: no MLX.
"""

from collections.abc import Sequence

CACHE_STEP = 256    # mlx_lm's KV caches grow in steps of this many positions
ROW_ROOM = 2        # beyond a row's KV: the next input's position, and a chained one
DECODE_PAGE = 64    # positions per decode page
KV_GROUPS = (32, 64, 128)   # values per scale and bias --kv-group-size takes
KV_GROUP = 32   # and by default: the best agreement (worker_proc/kv_quant.py)


def cache_width(n: int) -> int:
    """Positions a cache buffer holding `n` positions has: `n` rounded up to the step."""
    return -(-n // CACHE_STEP) * CACHE_STEP


def row_width(n: int) -> int:
    """The width the padded decode caches need for a longest row holding `n` KV
    positions."""
    return cache_width(n + ROW_ROOM)


def row_tokens(n: int, page: int) -> int:
    """Tokens the decode caches hold for a row of `n` KV positions: its pages, or
    (padded) the width it makes every row."""
    if not page:
        return row_width(n)
    return -(-(n + ROW_ROOM) // page) * page


def batch_tokens(lengths: Sequence[int], page: int = 0) -> int:
    """Tokens the decode caches span for rows holding `lengths` KV positions; 0 for
    no rows."""
    if not lengths:
        return 0
    if page:
        return sum(row_tokens(n, page) for n in lengths)
    return len(lengths) * row_width(max(lengths))


def decode_cache_budget(kv_capacity: int, max_running: int, page: int = 0) -> int:
    """Tokens the decode caches may span. Paged: every running token is also in the
    pool, so the pool's capacity plus a page of rounding per row covers any batch.
    Padded: a row as long as the pool allows (its KV and the next input's slot
    fill the pool), or a full batch of one-token rows."""
    if page:
        return kv_capacity + max_running * page
    return max(row_width(kv_capacity - 1), max_running * row_width(1))


def decode_cache_copies(page: int) -> int:
    """Copies of the decode caches memory must hold: two while a padded join copies
    the batch, one for pages."""
    return 1 if page else 2
