"""A plain numpy reference of the logits processing (worker_proc/penalties.py), and a
greedy decode loop applying it on mlx_lm's own model logits."""

from collections import Counter

import numpy as np

from mlxd.protocol import REPETITION_CONTEXT, SamplingParams


def processed_logits(logits, params: SamplingParams, prompt, generated, stop_ids=()):
    """The formulas, one token at a time: bias, then mlx_lm's repetition penalty over
    the last REPETITION_CONTEXT context tokens, then OpenAI's presence/frequency over
    the generated tokens, then min_tokens."""
    x = np.array(logits, dtype=np.float64)
    for t, b in zip(params.bias_ids, params.bias_values):
        x[t] += b
    if params.repetition_penalty != 1.0:
        for t in set((list(prompt) + list(generated))[-REPETITION_CONTEXT:]):
            x[t] = x[t] * params.repetition_penalty if x[t] < 0 else x[t] / params.repetition_penalty
    for t, c in Counter(generated).items():
        x[t] -= params.presence_penalty * (c > 0) + params.frequency_penalty * c
    if len(generated) < params.min_tokens:
        x[list(stop_ids)] = -np.inf
    return x


def reference_penalised_tokens(model_path: str, prompt: list[int], params: SamplingParams,
                               max_tokens: int, stop_ids=()) -> list[int]:
    """Greedy tokens of mlx_lm's generate_step with `processed_logits` as its logits
    processor (never stopping early)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from support import load_reference

    model, _ = load_reference(model_path)

    def process(tokens, logits):
        generated = tokens.tolist()[len(prompt):]
        row = np.array(logits[0].astype(mx.float32))
        return mx.array(processed_logits(row, params, prompt, generated, stop_ids)[None]
                        .astype(np.float32))

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                          logits_processors=[process])
    return [token for token, _ in steps]
