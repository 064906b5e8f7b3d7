"""Overlap on vs off through the whole server: the same tokens, and a worker that is
busy while the scheduler does its bookkeeping only when overlap is on."""

import asyncio

import pytest

from mlxd.client import AsyncClient
from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import PROMPTS, Server

LIMITS = [1, 2, 5, 9, 14, 20, 24, 24]   # max_tokens per prompt: finishes at different steps
SEEDED = dict(temperature=0.8, top_k=40, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def servers(llama_model):
    on = Server(llama_model, "--kv-capacity", "8192", "--log-level", "warning")
    try:
        off = Server(llama_model, "--kv-capacity", "8192", "--log-level", "warning",
                     "--disable-overlap")
    except BaseException:
        on.stop()
        raise
    yield {"on": on, "off": off}
    on.stop()
    off.stop()


async def _collect(stream, abort_after: int | None = None,
                   started: asyncio.Event | None = None):
    tokens, logprobs, finish = [], [], None
    async for chunk in stream:
        tokens += chunk.token_ids
        logprobs += chunk.logprobs or []
        finish = chunk.finish_reason or finish
        if started is not None and len(tokens) >= 3:
            started.set()
        if abort_after is not None and len(tokens) >= abort_after and finish is None:
            await stream.abort()
            abort_after = None
    return tokens, logprobs, finish


async def _scenario(address: str, params: dict) -> dict:
    """A steady batch finishing at different steps (max_tokens 1 and 2 among them),
    arrivals while it decodes, and an abort mid-stream."""
    async with AsyncClient(address, timeout=120) as c:
        def stream(prompt, n):
            return c.stream(prompt, max_tokens=n, logprobs=True, ignore_eos=True, **params)

        decoding = asyncio.Event()
        first = [asyncio.create_task(_collect(stream(p, n), started=decoding if n == 24 else None))
                 for p, n in zip(PROMPTS, LIMITS)]
        aborted = asyncio.create_task(_collect(stream(PROMPTS[3] + " again", 1500), abort_after=6))
        await asyncio.wait_for(decoding.wait(), 60)   # these arrive mid-stream:
        later = [asyncio.create_task(_collect(stream(p, 12))) for p in PROMPTS[4:7]]
        results = await asyncio.gather(*first, *later)
        return {"results": results, "aborted": await aborted, "stats": await c.stats()}


@pytest.mark.parametrize("params", [{}, SEEDED], ids=["greedy", "seeded"])
def test_overlap_on_and_off_give_the_same_tokens(servers, params):
    got = {name: asyncio.run(_scenario(s.address, params)) for name, s in servers.items()}
    on, off = got["on"], got["off"]
    assert on["stats"]["worker"]["overlap"] is True
    assert off["stats"]["worker"]["overlap"] is False
    assert on["stats"]["timing"]["chained_steps"] > 0
    assert off["stats"]["timing"]["chained_steps"] == 0
    for (t_on, lp_on, f_on), (t_off, lp_off, f_off) in zip(on["results"], off["results"]):
        assert t_on == t_off and f_on == f_off == "length"
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off)) < 1e-3
    assert [len(r[0]) for r in on["results"]] == LIMITS + [12, 12, 12]
    # the aborted stream: both stop early, on the same tokens as far as both went
    (t_on, _, f_on), (t_off, _, f_off) = on["aborted"], off["aborted"]
    assert f_on == f_off == "abort"
    assert 6 <= min(len(t_on), len(t_off)) and max(len(t_on), len(t_off)) < 1500
    n = min(len(t_on), len(t_off))
    assert t_on[:n] == t_off[:n]


# ---- idle time ---------------------------------------------------------------------

BUSY = TinySpec(arch="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                intermediate_size=512, vocab_size=2048, seed=3)


@pytest.fixture(scope="module")
def busy_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "busy", BUSY))


async def _steady_timing(address: str) -> dict:
    """Step timing over a window of steady decode steps of a 32-request batch."""
    async with AsyncClient(address, timeout=300) as c:
        tasks = [asyncio.create_task(c.generate(f"{PROMPTS[i % 8]} {i}", max_tokens=400,
                                                ignore_eos=True)) for i in range(32)]
        while (await c.stats())["running"] < 32:
            await asyncio.sleep(0.05)
        start = (await c.stats())["timing"]["steps"]
        while (await c.stats())["timing"]["steps"] < start + 300:   # a window of decodes only
            await asyncio.sleep(0.1)
        timing = (await c.stats())["timing"]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return timing


def test_worker_idle_time_is_small_with_overlap_and_not_without(busy_model):
    timings = {}
    for name, flags in (("on", ()), ("off", ("--disable-overlap",))):
        server = Server(busy_model, "--log-level", "warning", *flags)
        try:
            timings[name] = asyncio.run(_steady_timing(server.address))
        finally:
            server.stop()
    on, off = timings["on"], timings["off"]
    for t in (on, off):
        assert t["window"] == 256
        for key in ("compute_ms", "wait_ms", "idle_ms", "chained_wait_ms", "scheduler_ms"):
            assert t[key]["p50"] >= 0 and t[key]["mean"] >= 0
    assert on["chained_steps"] > 0 and off["chained_steps"] == 0
    # off: every round trip through the scheduler is time the worker waits, idle
    assert off["idle_ms"]["p50"] > 0 and off["idle_ms"]["p50"] == off["wait_ms"]["p50"]
    # on: the chained decode computes during that wait
    assert on["idle_fraction"] < 0.1 and on["idle_fraction"] < off["idle_fraction"] / 2
