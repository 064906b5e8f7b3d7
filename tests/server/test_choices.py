"""n choices through the real server: one request, n outputs sharing the prompt's KV."""

import asyncio
import random

from mlxd.client import AsyncClient, Client
from support import reference_tokens

VOCAB = 500


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def test_greedy_choices_equal_mlx_lm_and_share_the_prompts_kv(llama_server, llama_model):
    ids = random_ids(100, seed=11)
    with Client(llama_server.address, timeout=60) as c:
        results = c.generate(input_ids=ids, max_tokens=8, n=4, logprobs=True)
    want = [t for t, _ in reference_tokens(llama_model, ids, 8)]
    assert [r.index for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r.token_ids == want and r.finish_reason in ("length", "stop")
        assert r.usage["prompt_tokens"] == 100
    cached = sorted(r.usage["cached_tokens"] for r in results)
    assert cached == [0, 99, 99, 99]   # all but the last prompt token, computed once


def test_seeded_choices_are_reproducible_and_choice_0_is_the_single_request(llama_server):
    params = dict(input_ids=random_ids(40, seed=12), max_tokens=12, temperature=1.0, seed=5)
    with Client(llama_server.address, timeout=60) as c:
        first = c.generate(n=3, **params)
        again = c.generate(n=3, **params)
        single = c.generate(**params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert first[0].token_ids == single.token_ids and single.index == 0
    assert len({tuple(r.token_ids) for r in first}) > 1


def test_a_stream_of_choices_ends_after_every_choice_finished(llama_server):
    with Client(llama_server.address, timeout=60) as c:
        chunks = list(c.stream(input_ids=random_ids(30, seed=13), max_tokens=6, n=2,
                               ignore_eos=True))
    assert {ch.index for ch in chunks} == {0, 1}
    finals = [ch for ch in chunks if ch.finish_reason]
    assert sorted(ch.index for ch in finals) == [0, 1]
    assert all(ch.finish_reason == "length" and ch.usage["completion_tokens"] == 6
               for ch in finals)
    for i in (0, 1):
        assert sum(len(ch.token_ids) for ch in chunks if ch.index == i) == 6


def test_aborting_a_request_aborts_all_its_choices(llama_server):
    async def run():
        async with AsyncClient(llama_server.address, timeout=60) as c:
            stream = c.stream(input_ids=random_ids(30, seed=14), max_tokens=5000, n=3,
                              ignore_eos=True)
            chunks = [await stream.__anext__()]
            await stream.abort()
            chunks += [ch async for ch in stream]
            return chunks, await c.stats()

    chunks, stats = asyncio.run(run())
    finals = [ch for ch in chunks if ch.finish_reason]
    assert sorted(ch.index for ch in finals) == [0, 1, 2]
    assert all(ch.finish_reason == "abort" for ch in finals)
    assert stats["running"] == 0 and stats["used_slots"] == 0
