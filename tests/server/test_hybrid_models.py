"""Sliding-window and recurrent-state models through the whole server: greedy tokens
and chosen-token logprobs equal mlx_lm's, with 8 concurrent prompts, prompts longer
than the window, chunks that split it, a pool small enough to retract, overlap on and
off."""

import asyncio

import pytest

from mlxd.client import AsyncClient
from support import PROMPTS, Server, encode, pressure_prompts, reference_tokens

MAX_TOKENS = 40
LONG = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(2)]   # longer than the window
# three prompts each: 37 to 57 tokens, so every request starts in one 64-slot page and
# needs a second before it ends
TRIPLES = [" ".join((PROMPTS * 2)[i:i + 3]) for i in range(len(PROMPTS))]
ARCHS = ["gemma3_text", "gpt_oss", "cohere2", "qwen3_next", "lfm2", "mamba2", "falcon_h1"]
# chunks of 5 split the test models' 8-token windows; 192 slots (three pages) hold a
# long prompt and its output, but two requests that each need two pages do not fit
# together: whichever first crosses into its second page finds none free and nothing
# finished to evict, so a request is retracted and resumed
TIGHT = ("--chunked-prefill-size", "5", "--kv-capacity", "192", "--max-prefill-tokens", "64")


async def generate_all(address, prompts):
    async with AsyncClient(address, timeout=120) as c:
        results = await asyncio.gather(*(c.generate(p, max_tokens=MAX_TOKENS, logprobs=True,
                                                    ignore_eos=True)
                                         for p in prompts))
        return results, await c.stats()


def assert_matches(path, prompt, result):
    ref = reference_tokens(path, encode(path, prompt), MAX_TOKENS, ignore_eos=True)
    assert result.token_ids == [t for t, _ in ref], prompt
    assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3, prompt


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_chunked_retracted_requests_match_mlx_lm(arch, overlap, hybrid_model):
    path = hybrid_model(arch)
    args = TIGHT + (() if overlap else ("--disable-overlap",))
    server = Server(path, *args, "--log-level", "warning")
    try:
        prompts = TRIPLES + LONG
        results, stats = asyncio.run(generate_all(server.address, prompts))
        alone, _ = asyncio.run(generate_all(server.address, [LONG[0]]))
    finally:
        server.stop()
    for prompt, result in zip(prompts, results):
        assert_matches(path, prompt, result)
    assert_matches(path, LONG[0], alone[0])
    assert stats["retractions"] > 0
    assert stats["worker"]["overlap"] is overlap
    windowed = arch in ("gemma3_text", "gpt_oss", "cohere2")
    assert stats["worker"]["window_sizes"] == ([8] if windowed else [])
    assert (stats["worker"]["state_slots"] > 0) is (not windowed)


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2", "mamba2", "falcon_h1", "gemma3_text"])
def test_a_shared_prefix_is_served_from_the_cache(arch, hybrid_model):
    """Prompts extending a finished one resume from its cached KV and, for recurrent
    models, the snapshot of its state (cached_tokens > 0), and stay exact."""
    path = hybrid_model(arch)
    server = Server(path, "--log-level", "warning")
    extended = [LONG[0] + " " + p for p in PROMPTS[:3]]
    try:
        first, _ = asyncio.run(generate_all(server.address, [LONG[0]]))
        results, stats = asyncio.run(generate_all(server.address, extended))
    finally:
        server.stop()
    n = len(encode(path, LONG[0]))
    assert first[0].usage["cached_tokens"] == 0
    for prompt, result in zip(extended, results):
        assert n - 1 <= result.usage["cached_tokens"] < len(encode(path, prompt))
        assert_matches(path, prompt, result)
    if arch != "gemma3_text":
        assert stats["snapshots"] > 0


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_window_layers_keep_only_what_the_windows_need(arch, hybrid_model):
    """Long prompts on a sliding-window model decoding padded (in pages every layer's
    KV is in the pool): the window pool keeps `window + 1` positions per point the
    cache may extend (chunk ends and finishes), not one per token as the global
    layers' pool does, and the output stays exact."""
    path = hybrid_model(arch)
    server = Server(path, "--chunked-prefill-size", "48", "--decode-layout", "padded",
                    "--log-level", "warning")
    prompts = LONG + [p + " " + LONG[1] for p in PROMPTS[:6]]
    try:
        results, stats = asyncio.run(generate_all(server.address, prompts))
    finally:
        server.stop()
    for prompt, result in zip(prompts, results):
        assert_matches(path, prompt, result)
    window = 8
    points = sum(-(-len(encode(path, p)) // 48) + 1 for p in prompts)
    assert stats["worker"]["window_capacity"] > 0
    assert 0 < stats["cached_window_slots"] <= points * (window + 2)
    assert stats["cached_slots"] > 3 * stats["cached_window_slots"]
    assert stats["free_window_slots"] + stats["cached_window_slots"] == stats["window_slots"]


PRESSURE = ("--kv-capacity", "480", "--chunked-prefill-size", "40")


async def copies_after_firsts(address, prompts: list[list[int]], max_tokens: int):
    """Each prompt's second copy is sent when its first copy's first token arrives
    (so it may resume from a snapshot the first left), all concurrently."""
    async with AsyncClient(address, timeout=300) as c:
        async def one(ids):
            return await c.generate(input_ids=ids, max_tokens=max_tokens, logprobs=True,
                                    ignore_eos=True)

        async def pair(ids):
            first, copy = [], None
            async for chunk in c.stream(input_ids=ids, max_tokens=max_tokens, logprobs=True,
                                        ignore_eos=True):
                if copy is None:
                    copy = asyncio.ensure_future(one(ids))
                first += list(zip(chunk.token_ids, chunk.logprobs))
            return first, [(t, lp) for t, lp in zip((await copy).token_ids,
                                                    (await copy).logprobs)]

        pairs = await asyncio.gather(*(pair(ids) for ids in prompts[::2]))
        return [got for both in pairs for got in both], await c.stats()


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2", "falcon_h1", "gemma3_text"])
def test_duplicated_prompts_under_pressure_match_mlx_lm(arch, hybrid_model):
    """A 480-slot pool, chunks of 40, 36 greedy requests (12 short prompts and 6 long
    ones, each twice): retractions happen, second copies resume from first copies'
    snapshots, and every reply equals mlx_lm's."""
    path = hybrid_model(arch)
    prompts = pressure_prompts(path)
    server = Server(path, *PRESSURE, "--log-level", "warning")
    try:
        results, stats = asyncio.run(copies_after_firsts(server.address, prompts, 24))
    finally:
        server.stop()
    wrong = []
    for ids, got in zip(prompts, results):
        ref = reference_tokens(path, ids, 24, ignore_eos=True)
        if [t for t, _ in got] != [t for t, _ in ref] or \
                max(abs(a[1] - b[1]) for a, b in zip(got, ref)) >= 1e-3:
            wrong.append(len(ids))
    assert not wrong, f"prompt lengths whose replies differ from mlx_lm: {wrong}"
    assert stats["retractions"] > 0
