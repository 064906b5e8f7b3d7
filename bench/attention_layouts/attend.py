"""Attention written out by hand, for the layouts that merge partial softmaxes:
scores, their log-sum-exp, weights @ V, and the merge of two partials."""

import mlx.core as mx

from mlxd.runtime.kv_layout import CACHE_STEP, ROW_ROOM


def partial_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                      mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Softmax attention of queries `[..., M, D]` over keys/values `[..., N, D]`
    (batch dims broadcast; `mask` True where a key counts). Returns the normalised
    output `[..., M, D]` and the scores' log-sum-exp `[..., M]` (float32), which is
    what merging with attention over other keys needs. A query with no key counted
    gets output 0 and log-sum-exp -inf."""
    scores = (q * scale).astype(mx.float32) @ k.swapaxes(-1, -2).astype(mx.float32)
    weights, total, lse = softmax_parts(scores, mask)
    return (weights @ v.astype(mx.float32)) / total, lse


def softmax_parts(scores: mx.array, mask: mx.array | None) -> tuple[mx.array, ...]:
    """Unnormalised softmax weights of `scores [..., N]`, their sum `[..., 1]`
    (at least 1e-30) and the log-sum-exp `[...]`; masked-out scores count nothing."""
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    peak = mx.max(scores, axis=-1, keepdims=True)
    peak = mx.where(mx.isinf(peak), 0.0, peak)   # an all-masked query: no NaN
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    return weights, mx.maximum(total, 1e-30), (peak + mx.log(total)).squeeze(-1)


def merge_partials(a: tuple[mx.array, mx.array], b: tuple[mx.array, mx.array]) -> mx.array:
    """The attention over the union of two key sets, from each set's (output, lse)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    peak = mx.maximum(lse_a, lse_b)
    wa, wb = mx.exp(lse_a - peak)[..., None], mx.exp(lse_b - peak)[..., None]
    return (wa * out_a + wb * out_b) / (wa + wb)


def grouped(q: mx.array, n_kv: int) -> mx.array:
    """Queries `[B, Hq, 1, D]` as `[B, Hkv, G, D]`: each KV head's G query heads
    become its rows, so grouped-query attention is one product per KV head."""
    b, hq, _, d = q.shape
    return q.reshape(b, n_kv, hq // n_kv, d)


def class_capacity(length: int) -> int:
    """The width class of a row holding `length` positions: the smallest power of
    two times CACHE_STEP that also has the decode's ROW_ROOM."""
    cap = CACHE_STEP
    while cap < length + ROW_ROOM:
        cap *= 2
    return cap


def length_mask(lengths: list[int], width: int) -> mx.array:
    """`[rows, 1, 1, width]`: True at each row's first `lengths[i]` columns."""
    return (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]
