"""The decode batch: the one interface the ModelRunner speaks to the running rows, its
two layouts, and the choice between them, made once at startup.

- pages (`paged_batch.PagedDecodeBatch`): each row's KV in the KV pool's pages the
  scheduler booked, attended in place (`decode_pages`); the default where the
  model's attention goes through mlx_lm's `scaled_dot_product_attention`;
- padded (`decode_batch.DecodeBatch`): mlx_lm's batch caches, every row as wide as
  the longest.

`runtime/kv_layout.py` is the rule both layouts are budgeted by (`page`: 0 padded).
"""

from dataclasses import dataclass, replace
from typing import Protocol

import mlx.core as mx

from mlxd.runtime.kv_layout import DECODE_PAGE

from .batch_cache import LayerCache
from .kv_pool import KVGeometry
from .sampling import RowState


class UnsupportedModel(ValueError):
    pass


@dataclass
class JoinGroup:
    """Freshly prefilled requests waiting to join the batch, rows in cache order."""

    rids: list[int]
    rows: list[RowState]
    caches: list[LayerCache]
    first_tokens: mx.array   # [B], lazy
    # per row, the pool slots of the positions its cache holds (the prefix's, then the
    # new tokens'): the pool pages the row reads in place (paged_batch); None: none
    slots: list[list[int]] | None = None


class DecodeRows(Protocol):
    """The running requests' decode state, rows in order. `row_rids` may hold None
    for a released row not yet dropped (padded); `rids` are the live ones."""

    page: int                       # positions per page; 0: the padded layout
    pool: object                    # the KVPool its rows read in place (None: padded)
    direct: list[int]               # the last forward's new positions: the pool slot each
                                    # was written at by the forward (0: the runner writes it)
    row_rids: list[int | None]
    rows: list[RowState]
    tokens: mx.array | None         # [rows] each row's next input token

    @property
    def rids(self) -> list[int]: ...

    def __len__(self) -> int: ...

    def add(self, groups: list[JoinGroup]) -> None:
        """The groups' rows join, after the running ones."""

    def remove(self, rids: set[int]) -> None:
        """Release these rows."""

    def clear(self) -> None:
        """Drop every row (after a failed step)."""

    def forward(self, model, slots: list[list[int]] | None = None) -> mx.array:
        """Logits `[rows, V]` for every row's next token (lazy); `slots`: each row's
        slot for its input (None: a chained decode's, where its pages put it)."""

    def knows_next(self) -> bool:
        """Every row's next position has a place: a chained decode may run."""

    def booked(self, rid_pages: dict[int, int]) -> None:
        """The pool pages (`DecodeRow.chain_page`) rows' next positions start."""

    def newest_kv(self) -> list[tuple[mx.array, mx.array]]:
        """Per KV layer, keys/values `[rows, heads, dim]` the last forward computed
        and the runner still writes to the pool (pages: none, the forward did)."""

    def pending_writes(self) -> list[mx.array]:
        """What a step evaluates to complete the batch's own writes."""

    def before_joins(self, decoded: list[mx.array]) -> None:
        """A join is about to write into the batch after a decode read it."""


def decode_page_for(model, geometry: KVGeometry, layout: str = "auto") -> int:
    """Positions per decode page for the model, or 0 for the padded layout: "paged"
    (UnsupportedModel if the model's attention does not go through the hook),
    "padded", or "auto" (pages where the hook reaches every attention layer; a model
    without KV layers has nothing to page). Probes the model once (a 2-row decode)."""
    from .decode_pages import install_hook
    from .kv_pool import KVPool
    from .paged_batch import paged_decode_reaches

    if layout not in ("auto", "paged", "padded"):
        raise ValueError(f"unknown decode layout {layout!r} (auto, paged or padded)")
    if layout == "padded" or not geometry.num_layers:
        return 0
    install_hook(model)
    g = replace(geometry, k_bits=0, v_bits=0)
    probe = KVPool(g, 2 * DECODE_PAGE, page=DECODE_PAGE)
    if paged_decode_reaches(model, g.cache_layout, arena_for(g, DECODE_PAGE), probe):
        return DECODE_PAGE
    if layout == "paged":
        raise UnsupportedModel("mlxd cannot decode this model in pages: its attention does "
                               "not call mlx_lm's scaled_dot_product_attention")
    return 0


def float_tail_bytes(geometry: KVGeometry, page: int, float_tail: int, max_rows: int,
                     slack: int) -> int:
    """Memory the float tails of `max_rows` rows (verifies of up to `slack` drafts)
    take in the decode pages (`page`; the padded layout has none), where the
    geometry's KV is quantized: a ring each, and ring 0 (never handed out)."""
    if not (page and float_tail and (geometry.k_bits or geometry.v_bits)):
        return 0
    from .decode_pages import tail_ring

    float_kv = replace(geometry, k_bits=0, v_bits=0)
    return (max_rows + 1) * tail_ring(float_tail, slack) * float_kv.bytes_per_token


def arena_for(geometry: KVGeometry, page: int, float_tail: int = 0, max_rows: int = 0,
              tail_slack: int = 0, all_rings: bool = False):
    """The arena beside a paged batch's pool: its page 0 (padding and scratch
    positions) and, where the geometry's KV is quantized, the rows' float tails."""
    from .decode_pages import PageArena

    g = geometry
    return PageArena(g.num_layers, g.n_kv_heads, g.k_head_dim, g.v_head_dim, g.dtype, 0, page,
                     k_bits=g.k_bits, v_bits=g.v_bits, group=g.kv_group, float_tail=float_tail,
                     max_rows=max_rows, tail_slack=tail_slack, all_rings=all_rings)


def decode_rows(geometry: KVGeometry, page: int, pool, all_rings: bool = False,
                float_tail: int = 0, max_rows: int = 0, tail_slack: int = 0) -> DecodeRows:
    """The decode batch of the layout `decode_page_for` chose (`page`; 0: padded). In
    pages, rows read `pool` (a KVPool of pages of `page` positions, with no window
    pool) in place. Quantized pages keep each row's newest `float_tail` positions in
    float too, for up to `max_rows` rows (rings for all of them at once with
    `all_rings`) and verifies of up to `tail_slack` drafts (memory: `float_tail_bytes`)."""
    from .decode_batch import DecodeBatch
    from .paged_batch import PagedDecodeBatch

    if not page:
        return DecodeBatch(geometry.layout)
    arena = arena_for(geometry, page, float_tail, max_rows, tail_slack, all_rings)
    return PagedDecodeBatch(geometry.cache_layout, arena, pool)
