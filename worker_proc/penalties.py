"""Per-row logits processing before a token is picked: logit_bias, the repetition,
presence and frequency penalties, min_tokens.

Applied in this order, on the raw logits of the rows that ask for any of it:
1. logit_bias: `logits[t] += bias[t]`;
2. repetition (mlx_lm's `make_repetition_penalty`): every distinct token among the
   last REPETITION_CONTEXT tokens of prompt + output is scaled once, a positive logit
   divided by the penalty, a negative one multiplied by it;
3. presence / frequency (OpenAI's): `logits[t] -= presence * (count[t] > 0) +
   frequency * count[t]`, `count` over the tokens generated so far;
4. min_tokens: the request's stop ids (EOS included) are -inf until that many tokens
   were generated.

A row's counts and window are lazy MLX arrays updated with each sampled token, so a
decode chained on the previous step's unread tokens counts them. Both are built from
the prefill's `prompt_tail` and `output_ids`, which the scheduler sends again when it
resumes a retracted request.
"""

import mlx.core as mx

from mlxd.protocol import REPETITION_CONTEXT, PrefillInput, SamplingParams


class RowPenalties:
    """The logits-processing state of one request (only of one that asks for it)."""

    def __init__(self, params: SamplingParams, vocab: int, prompt_tail: list[int] = (),
                 output_ids: list[int] = (), stop_ids: list[int] = ()):
        self.params = params
        self.bias = None        # [V] float32
        self.window = None      # [W] int32; short contexts repeat their oldest token
        self.counts = None      # [V] float32, times each token was generated
        self.stop_mask = None   # [V] bool
        if params.biases_logits:
            self.bias = mx.zeros((vocab,)).at[mx.array(params.bias_ids)].add(
                mx.array(params.bias_values, dtype=mx.float32))
        if params.penalises_repeats:
            context = (list(prompt_tail) + list(output_ids))[-REPETITION_CONTEXT:] or [0]
            pad = [context[0]] * (REPETITION_CONTEXT - len(context))
            self.window = mx.array(pad + context, dtype=mx.int32)
        if params.penalises_counts:
            self.counts = mx.zeros((vocab,))
            if output_ids:
                self.counts = self.counts.at[mx.array(list(output_ids))].add(1.0)
        if params.holds_stops() and stop_ids:
            self.stop_mask = mx.zeros((vocab,)).at[mx.array(list(stop_ids))].add(1.0) > 0

    @classmethod
    def for_prefill(cls, p: PrefillInput, vocab: int) -> "RowPenalties | None":
        if not p.sampling.processes_logits:
            return None
        return cls(p.sampling, vocab, p.prompt_tail, p.output_ids, p.stop_token_ids)

    def record(self, token: mx.array) -> None:
        """Count the token just sampled (a lazy 1-element array)."""
        if self.window is not None:
            self.window = mx.concatenate([self.window[1:], token.astype(mx.int32)])
        if self.counts is not None:
            self.counts = self.counts.at[token].add(1.0)


def _stacked(states: list[RowPenalties], name: str, fill: mx.array) -> mx.array | None:
    """The rows' `name` arrays as one [P, ...] array (`fill` where a row has none);
    None when no row has one."""
    arrays = [getattr(s, name) for s in states]
    if all(a is None for a in arrays):
        return None
    return mx.stack([fill if a is None else a for a in arrays])


def _column(values: list[float]) -> mx.array:
    return mx.array(values, dtype=mx.float32)[:, None]


def apply(logits: mx.array, states: list[RowPenalties], generated: list[int]) -> mx.array:
    """The processed logits `[P, V]` of float32 `logits` `[P, V]`, row i by `states[i]`,
    which has generated `generated[i]` tokens so far."""
    vocab = logits.shape[-1]
    x = logits
    bias = _stacked(states, "bias", mx.zeros((vocab,)))
    if bias is not None:
        x = x + bias
    window = _stacked(states, "window", mx.zeros((REPETITION_CONTEXT,), dtype=mx.int32))
    if window is not None:
        seen = mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), window,
                                 mx.array(True), axis=-1)
        penalty = _column([s.params.repetition_penalty for s in states])
        x = mx.where(seen, mx.where(x < 0, x * penalty, x / penalty), x)
    counts = _stacked(states, "counts", mx.zeros((vocab,)))
    if counts is not None:
        presence = _column([s.params.presence_penalty for s in states])
        frequency = _column([s.params.frequency_penalty for s in states])
        x = x - presence * (counts > 0) - frequency * counts
    held = [s.stop_mask if s.stop_mask is not None and s.params.holds_stops(n) else None
            for s, n in zip(states, generated)]
    if any(m is not None for m in held):
        no_mask = mx.zeros((vocab,), dtype=mx.bool_)
        x = mx.where(mx.stack([no_mask if m is None else m for m in held]), -mx.inf, x)
    return x
