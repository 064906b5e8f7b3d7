"""A client that disconnects mid-request has its request aborted at once, streamed
or not: the scheduler shows it gone and its KV freed. The model has a long context,
so that its requests would otherwise run on for a long while."""

import asyncio

import httpx
import pytest

from mlxd import Client
from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import Server, requests_in_server, wait_until

STREAMS = 4
CONTEXT = 32768


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = TinySpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, vocab_size=512, seed=0,
                    max_position_embeddings=CONTEXT)
    model = build_tiny_model(tmp_path_factory.mktemp("models") / "long", spec)
    srv = Server(str(model), "--kv-capacity", str(6 * CONTEXT), "--log-level", "warning")
    yield srv
    srv.stop()


def test_a_disconnected_client_has_its_requests_aborted(server):
    body = {"model": "long", "prompt": "Once upon a time", "max_tokens": CONTEXT,
            "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            streams = [client.stream("POST", "/v1/completions", json={**body, "stream": True})
                       for _ in range(STREAMS)]
            responses = [await s.__aenter__() for s in streams]
            assert all(r.status_code == 200 for r in responses)
            lines = [r.aiter_lines() for r in responses]   # kept: dropping one closes it
            for line in lines:   # each has started generating
                await line.__anext__()
            waiting = asyncio.create_task(client.post("/v1/completions", json=body))
            assert await asyncio.to_thread(
                wait_until, lambda: requests_in_server(server.address) == STREAMS + 1, 30)
            waiting.cancel()   # the non-streamed request's connection closes
            for line, s in zip(lines, streams):
                await line.aclose()
                await s.__aexit__(None, None, None)
    asyncio.run(run())
    assert wait_until(lambda: requests_in_server(server.address) == 0, 3), \
        "requests ran on for nobody"
    with Client(server.address, timeout=30) as c:
        assert c.stats()["used_slots"] == 0
