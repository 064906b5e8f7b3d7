"""Prefix cache, chunked prefill and retraction through the real server, against mlx_lm."""

import asyncio
import random

import pytest

from mlxd.client import AsyncClient, Client, MlxdError
from support import Server, flood, reference_tokens

MAX_TOKENS = 16
VOCAB = 500   # the tiny test models' tokenizers have 512 tokens


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def assert_matches(model, ids, result, max_tokens=MAX_TOKENS):
    ref = reference_tokens(model, ids, max_tokens)
    assert result.token_ids == [t for t, _ in ref]
    assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3


def generate(client, ids, **params):
    return client.generate(input_ids=ids, max_tokens=MAX_TOKENS, logprobs=True, **params)


@pytest.fixture(scope="module")
def cached_server(llama_model):
    server = Server(llama_model, "--kv-capacity", "8192", "--log-level", "warning")
    yield server
    server.stop()


def test_fully_cached_prompt(cached_server, llama_model):
    ids = random_ids(90, seed=1)
    with Client(cached_server.address, timeout=60) as c:
        first = generate(c, ids)
        again = generate(c, ids)
    assert first.usage["cached_tokens"] == 0
    assert again.usage["cached_tokens"] == len(ids) - 1   # the last token is recomputed
    assert_matches(llama_model, ids, first)
    assert_matches(llama_model, ids, again)


def test_partially_cached_prompt(cached_server, llama_model):
    shared = random_ids(70, seed=2)
    with Client(cached_server.address, timeout=60) as c:
        generate(c, shared + random_ids(20, seed=3))
        result = generate(c, shared + random_ids(25, seed=4))
    assert len(shared) <= result.usage["cached_tokens"] < len(shared) + 25
    assert_matches(llama_model, shared + random_ids(25, seed=4), result)


def test_prefix_cached_by_a_request_that_is_still_running(cached_server, llama_model):
    prompt = random_ids(80, seed=5)
    with Client(cached_server.address, timeout=60) as c:
        running = c.stream(input_ids=prompt, max_tokens=1500, ignore_eos=True)
        next(running)   # its prompt's KV is in the tree from now on
        follower = prompt + random_ids(10, seed=6)
        result = generate(c, follower)
        assert c.stats()["running"] >= 1
        running.abort()
        assert list(running)[-1].finish_reason == "abort"
    assert result.usage["cached_tokens"] >= len(prompt)
    assert_matches(llama_model, follower, result)


def test_stats_account_for_every_slot_when_idle(cached_server):
    with Client(cached_server.address, timeout=60) as c:
        stats = c.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["used_slots"] == 0
    assert stats["free_slots"] + stats["cached_slots"] == stats["capacity"] == 8192


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_mlx_lm(chunk, llama_model):
    server = Server(llama_model, "--kv-capacity", "4096", "--chunked-prefill-size", str(chunk),
                    "--log-level", "warning")
    long_prompt = random_ids(150 if chunk > 1 else 40, seed=10 + chunk)
    short_prompt = random_ids(12, seed=20 + chunk)
    try:
        async def both():
            async with AsyncClient(server.address, timeout=120) as c:
                return await asyncio.gather(
                    c.generate(input_ids=short_prompt, max_tokens=60, logprobs=True),
                    c.generate(input_ids=long_prompt, max_tokens=MAX_TOKENS, logprobs=True))

        decoding, chunked = asyncio.run(both())   # one decodes while the other is chunked
        assert_matches(llama_model, short_prompt, decoding, max_tokens=60)
        assert_matches(llama_model, long_prompt, chunked)
    finally:
        server.stop()


def test_without_the_radix_cache_outputs_are_the_same(llama_model):
    server = Server(llama_model, "--kv-capacity", "4096", "--disable-radix-cache",
                    "--log-level", "warning")
    ids = random_ids(60, seed=30)
    try:
        with Client(server.address, timeout=60) as c:
            results = [generate(c, ids), generate(c, ids)]
            stats = c.stats()
        for result in results:
            assert result.usage["cached_tokens"] == 0
            assert_matches(llama_model, ids, result)
        assert stats["cached_slots"] == 0 and stats["free_slots"] == 4096
    finally:
        server.stop()


def test_a_flood_on_a_small_cache_completes_by_retraction(llama_model):
    """12 requests needing ~2,600 slots on a 640-slot pool: requests are retracted
    and resumed, every one finishes with the tokens it gets alone, no slot leaks."""
    server = Server(llama_model, "--kv-capacity", "640", "--max-running-requests", "12",
                    "--mem-limit-gb", "2", "--log-level", "warning")
    prompts = [random_ids(60 + 7 * i, seed=40 + i) for i in range(12)]
    try:
        results, stats = flood(server.address, prompts, 120)
    finally:
        server.stop()
    assert stats["retractions"] > 0
    for ids, result in zip(prompts, results):
        assert result.finish_reason == "length"
        ref = reference_tokens(llama_model, ids, 120, ignore_eos=True)
        assert result.token_ids == [t for t, _ in ref]
        assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3
    assert stats["used_slots"] == 0 and stats["free_slots"] + stats["cached_slots"] == 640
    assert stats["worker"]["peak_memory"] < 2 * 1024**3


def test_a_request_too_big_for_the_pool_gets_an_error_up_front(llama_model):
    """100 prompt tokens + max_tokens 100 cannot fit 128 slots: refused before any
    token is generated (by the tokenizer's check, or else by the scheduler's)."""
    server = Server(llama_model, "--kv-capacity", "128", "--log-level", "warning")
    try:
        with Client(server.address, timeout=60) as c:
            try:
                result = c.generate(input_ids=random_ids(100, seed=50), max_tokens=100,
                                    ignore_eos=True)
            except MlxdError as err:
                assert err.code == "invalid_request" and "max_tokens" in str(err)
            else:
                assert result.finish_reason == "error" and "max_tokens" in result.error
                assert result.token_ids == []
            ok = c.generate(input_ids=random_ids(10, seed=51), max_tokens=5)
            assert ok.finish_reason in ("length", "stop")
    finally:
        server.stop()


def test_cached_tokens_survive_a_stop_string_finish(cached_server, llama_model):
    """A stop string ends the request in the tokenizer, before the scheduler's final
    usage: cached_tokens comes from the first token's usage."""
    ids = random_ids(60, seed=60)
    with Client(cached_server.address, timeout=60) as c:
        plain = c.generate(input_ids=ids, max_tokens=MAX_TOKENS)
        stop = plain.text[3:6]
        if not stop.strip():
            pytest.skip("the greedy text has no usable stop string")
        stopped = c.generate(input_ids=ids, max_tokens=MAX_TOKENS, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.usage["cached_tokens"] == len(ids) - 1
