"""Requests of a client that is gone are aborted at once, not run for nobody: the
client's connection ending (process killed, socket closed) aborts them on the server,
whatever the SDK did or did not send."""

import subprocess
import sys
import textwrap

import pytest

from mlxd import Client
from mlxd.protocol import GenerateRequest, StreamChunk
from support import ROOT, RawDealer, Server, requests_in_server, wait_until

STREAMS = 20


@pytest.fixture(scope="module")
def server(llama_model):
    srv = Server(llama_model, "--kv-capacity", "16384", "--log-level", "warning")
    yield srv
    srv.stop()


def test_a_killed_clients_requests_are_aborted(server):
    code = textwrap.dedent(f"""
        import asyncio, sys
        from mlxd import AsyncClient
        async def main():
            c = AsyncClient({server.address!r})
            streams = [c.stream("Once upon a time", max_tokens=100000, ignore_eos=True)
                       for _ in range({STREAMS})]
            for s in streams:
                await s.start()
            async for _ in streams[0]:
                print("streaming", flush=True)
                await asyncio.sleep(3600)
        asyncio.run(main())
    """)
    client = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout.readline().strip() == "streaming"
        assert wait_until(lambda: requests_in_server(server.address) == STREAMS, 30)
        client.kill()
        client.wait()
        assert wait_until(lambda: requests_in_server(server.address) == 0, 3), "requests ran on for nobody"
    finally:
        client.kill()


def test_a_closed_socket_ends_its_requests_without_an_abort(server):
    """The raw protocol, no SDK: a DEALER sends requests, then closes without aborting."""
    with RawDealer(server.address) as dealer:
        for i in range(5):
            dealer.send(GenerateRequest(f"r{i}", prompt="Hello", stream=True,
                                        params={"max_tokens": 100000, "ignore_eos": True}))
        assert isinstance(dealer.recv(), StreamChunk)
        assert wait_until(lambda: requests_in_server(server.address) == 5, 30)
    assert wait_until(lambda: requests_in_server(server.address) == 0, 3), "requests ran on for nobody"


def test_other_clients_keep_their_requests(server):
    """Another client's connection ending leaves this one's stream running."""
    with Client(server.address, timeout=60) as keeper:
        stream = keeper.stream("Hello", max_tokens=300, ignore_eos=True)
        chunks = iter(stream)
        next(chunks)
        with RawDealer(server.address) as other:
            other.send(GenerateRequest("x", prompt="Hi", params={"max_tokens": 5}))
            other.recv()
        tokens = sum(len(c.token_ids) for c in chunks)
        assert tokens == 299
