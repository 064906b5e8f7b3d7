"""Penalties, logit_bias and min_tokens through the real server: rows batched with plain
ones and resumed after retractions decode as a reference loop on mlx_lm's logits."""

import asyncio
import random

from mlxd.client import AsyncClient, Client
from mlxd.protocol import SamplingParams
from penalty_reference import reference_penalised_tokens
from support import Server, reference_tokens

VOCAB = 500   # the tiny test models' tokenizers have 512 tokens
MAX_TOKENS = 100


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


# client parameters, and the same as the worker's SamplingParams
PENALTIES = [
    ({"presence_penalty": 2.0, "frequency_penalty": 1.5, "logit_bias": {"5": 30}},
     SamplingParams(presence_penalty=2.0, frequency_penalty=1.5, bias_ids=[5], bias_values=[30.0])),
    ({"repetition_penalty": 1.5}, SamplingParams(repetition_penalty=1.5)),
    ({"frequency_penalty": -1.0, "repetition_penalty": 0.8},
     SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.8)),
    ({"logit_bias": {"7": 25, "9": -100}, "presence_penalty": 1.0},
     SamplingParams(bias_ids=[7, 9], bias_values=[25.0, -100.0], presence_penalty=1.0)),
]


def test_penalised_requests_batched_and_retracted_decode_as_the_reference(llama_model):
    """12 requests on a 640-slot pool (retractions), 8 of them penalised: each
    decodes as the reference, the plain ones as mlx_lm; nothing leaks."""
    server = Server(llama_model, "--kv-capacity", "640", "--max-running-requests", "12",
                    "--log-level", "warning")
    prompts = [random_ids(60 + 7 * i, seed=70 + i) for i in range(12)]
    params = [PENALTIES[i % 4] if i % 3 else ({}, None) for i in range(12)]
    try:
        async def flood():
            async with AsyncClient(server.address, timeout=300) as c:
                results = await asyncio.gather(*(
                    c.generate(input_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, **client)
                    for p, (client, _) in zip(prompts, params)))
                return results, await c.stats()

        results, stats = asyncio.run(flood())
    finally:
        server.stop()
    assert stats["retractions"] > 0
    for ids, (_, sampling), result in zip(prompts, params, results):
        assert result.finish_reason == "length"
        if sampling is None:
            want = [t for t, _ in reference_tokens(llama_model, ids, MAX_TOKENS, ignore_eos=True)]
        else:
            want = reference_penalised_tokens(llama_model, ids, sampling, MAX_TOKENS)
        assert result.token_ids == want, sampling
    assert stats["used_slots"] == 0 and stats["free_slots"] + stats["cached_slots"] == 640


def test_min_tokens_holds_back_the_stop_ids(llama_server, llama_model):
    ids = random_ids(20, seed=3)
    first = [t for t, _ in reference_tokens(llama_model, ids, 3, ignore_eos=True)]
    with Client(llama_server.address, timeout=60) as c:
        stopped = c.generate(input_ids=ids, max_tokens=8, stop_token_ids=[first[0]])
        held = c.generate(input_ids=ids, max_tokens=8, stop_token_ids=first[:2], min_tokens=3)
    assert stopped.token_ids == first[:1] and stopped.finish_reason == "stop"
    want = reference_penalised_tokens(llama_model, ids, SamplingParams(min_tokens=3), 8,
                                      stop_ids=first[:2])
    assert want[:3] != first[:3] and not set(want[:3]) & set(first[:2])
    n = next((i for i, t in enumerate(want) if i >= 3 and t in first[:2]), len(want) - 1)
    assert held.token_ids == want[:n + 1]
