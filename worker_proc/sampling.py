"""Batched token selection: penalties and bias, grammar masks, greedy, temperature,
top-k, top-p, min-p, seeded.

Every request owns a seed; the random key for its n-th token is derived from
(seed, n) alone, so a seeded request samples the same tokens whatever else
shares its batch. Rows with penalties, logit_bias or min_tokens pick from their
processed logits (penalties.py); the other rows of the batch skip that work. A
grammar mask (grammar.py) then removes the tokens a constrained row may not pick.
Reported logprobs (chosen and top) are always the model's raw log-softmax, before
any processing, as mlx_lm reports them.
"""

from dataclasses import dataclass

import mlx.core as mx

from mlxd.protocol import SamplingParams

from . import penalties
from .grammar import RowGrammar
from .penalties import RowPenalties
from .thinking import ThinkBudget

_MASK64 = (1 << 64) - 1


def step_key(seed: int, n: int) -> mx.array:
    mixed = (seed * 0x9E3779B97F4A7C15 + n * 0xBF58476D1CE4E5B9) & _MASK64
    return mx.random.key(mixed)


@dataclass
class RowState:
    """Sampling state of one running request."""

    params: SamplingParams
    seed: int
    generated: int = 0   # tokens sampled so far; indexes the random key
    penalties: RowPenalties | None = None   # only when the params process the logits
    grammar: RowGrammar | None = None       # only for a constrained request
    thinking: "ThinkBudget | None" = None   # only under a thinking budget


@dataclass
class Sampled:
    """Lazy outputs for a batch of rows."""

    tokens: mx.array                  # [B] int32
    logprobs: mx.array                # [B] chosen-token logprobs
    top_ids: mx.array | None = None   # [B, n] unsorted
    top_logprobs: mx.array | None = None
    probs: mx.array | None = None     # [B, V] what each row sampled from (when asked)


def _mask_below(x: mx.array, threshold: mx.array) -> mx.array:
    return mx.where(x >= threshold, x, -mx.inf)


def _filter(x: mx.array, params: list[SamplingParams]) -> mx.array:
    """Apply top-k, top-p and min-p to temperature-scaled logprobs `x` [S, V]."""
    vocab = x.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_x = -mx.sort(-x, axis=-1)
        ks = mx.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
        kth = mx.take_along_axis(sorted_x, (ks - 1)[:, None], axis=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = mx.array([p.top_p for p in params])[:, None]
            probs = mx.softmax(sorted_x, axis=-1)
            keep = (mx.cumsum(probs, axis=-1) - probs) < top_p
            nucleus = mx.min(mx.where(keep, sorted_x, mx.inf), axis=-1, keepdims=True)
            # a top_p that underflows float32 keeps nothing: the most likely token stays
            nucleus = mx.minimum(nucleus, sorted_x[:, :1])
            kth = mx.maximum(kth, nucleus)
        x = _mask_below(x, kth)
    if any(p.min_p > 0.0 for p in params):
        min_p = mx.array([p.min_p for p in params])[:, None]
        x = _mask_below(x, mx.max(x, axis=-1, keepdims=True) + mx.log(min_p))
    return x


def _sample_rows(logprobs: mx.array, rows: list[RowState]) -> mx.array:
    params = [r.params for r in rows]
    temps = mx.array([p.temperature for p in params])[:, None]
    x = _filter(logprobs / temps, params)
    vocab = logprobs.shape[-1]
    noise = mx.stack([mx.random.gumbel((vocab,), key=step_key(r.seed, r.generated))
                      for r in rows])
    return mx.argmax(x + noise, axis=-1)


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _processed(logits: mx.array, logprobs: mx.array, rows: list[RowState],
               idx: list[int]) -> mx.array:
    """The logprobs to pick from: those of the processed logits in rows `idx`,
    `logprobs` (raw) in the others."""
    if len(idx) == len(rows):
        return _log_softmax(penalties.apply(logits, [r.penalties for r in rows],
                                            [r.generated for r in rows]))
    at = mx.array(idx)
    scores = mx.array(logprobs)   # a copy: the raw logprobs are reported
    scores[at] = _log_softmax(penalties.apply(
        logits[at], [rows[i].penalties for i in idx], [rows[i].generated for i in idx]))
    return scores


def _record(tokens: mx.array, rows: list[RowState], idx: list[int]) -> None:
    for i in idx:
        rows[i].penalties.record(tokens[i:i + 1])


def distribution(scores: mx.array, rows: list[RowState]) -> mx.array:
    """`[B, V]`: the probabilities row i samples its token from, given the logprobs
    it picks from (`scores`): temperature, top-k, top-p, min-p; a greedy row's is
    all on its most likely token."""
    greedy = mx.array([r.params.greedy for r in rows])[:, None]
    temps = mx.array([r.params.temperature if not r.params.greedy else 1.0
                      for r in rows])[:, None]
    probs = mx.softmax(_filter(scores / temps, [r.params for r in rows]), axis=-1)
    top = mx.argmax(scores, axis=-1, keepdims=True)
    one_hot = mx.arange(scores.shape[-1])[None, :] == top
    return mx.where(greedy, one_hot.astype(probs.dtype), probs)


def sample(logits: mx.array, rows: list[RowState], allowed: mx.array | None = None,
           probs: bool = False) -> Sampled:
    """Pick one token per row of `logits` [B, V], among those `allowed` [B, V] (bool)
    lets it when given, and advance each row's state (its count, its penalties'
    record of the token, lazily; a grammar advances once the token is read). With
    `probs`, the result holds what each row sampled from (`distribution`)."""
    logits = logits.astype(mx.float32)
    logprobs = _log_softmax(logits)
    processed_idx = [i for i, r in enumerate(rows) if r.penalties is not None]
    scores = _processed(logits, logprobs, rows, processed_idx) if processed_idx else logprobs
    if allowed is not None:
        scores = mx.where(allowed, scores, -mx.inf)
    chances = distribution(scores, rows) if probs else None
    tokens = mx.argmax(scores, axis=-1)
    sampled_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled_idx) == len(rows):
        tokens = _sample_rows(scores, rows)
    elif sampled_idx:
        idx = mx.array(sampled_idx)
        tokens[idx] = _sample_rows(scores[idx], [rows[i] for i in sampled_idx])
    _record(tokens, rows, processed_idx)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    out = Sampled(tokens, chosen, probs=chances)
    n_top = max(r.params.top_logprobs for r in rows)
    if n_top > 0:
        n_top = min(n_top, logprobs.shape[-1])
        out.top_ids = mx.argpartition(-logprobs, kth=n_top - 1, axis=-1)[:, :n_top]
        out.top_logprobs = mx.take_along_axis(logprobs, out.top_ids, axis=-1)
    for r in rows:
        r.generated += 1
    return out


def top_lists(ids: list[int], lps: list[float], n: int) -> list[list]:
    """Sort one row's top candidates by logprob and keep `n`: `[ids, logprobs]`."""
    order = sorted(range(len(ids)), key=lambda j: -lps[j])[:n]
    return [[ids[j] for j in order], [lps[j] for j in order]]
