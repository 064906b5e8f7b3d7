"""Requests of a client that is gone are aborted at once, not run for nobody: the
client's connection ending (process killed, socket closed) aborts them on the server,
whatever the SDK did or did not send."""

import subprocess
import sys
import textwrap

import pytest
import zmq

from mlxd import Client
from mlxd.protocol import Decoder, GenerateRequest, StreamChunk, encode
from support import ROOT, Server, wait_until

STREAMS = 20


@pytest.fixture(scope="module")
def server(llama_model):
    srv = Server(llama_model, "--kv-capacity", "16384", "--log-level", "warning")
    yield srv
    srv.stop()


def _running(server) -> int:
    with Client(server.address, timeout=30) as c:
        stats = c.stats()
        return stats["running"] + stats["waiting"]


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
        assert wait_until(lambda: _running(server) == STREAMS, 30)
        client.kill()
        client.wait()
        assert wait_until(lambda: _running(server) == 0, 3), "requests ran on for nobody"
    finally:
        client.kill()


def test_a_closed_socket_ends_its_requests_without_an_abort(server):
    """The raw protocol, no SDK: a DEALER sends requests, then closes without aborting."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.address)
    for i in range(5):
        sock.send(encode(GenerateRequest(f"r{i}", prompt="Hello", stream=True,
                                         params={"max_tokens": 100000, "ignore_eos": True})))
    assert isinstance(Decoder(StreamChunk).decode(sock.recv()), StreamChunk)
    assert wait_until(lambda: _running(server) == 5, 30)
    sock.close(linger=0)
    ctx.term()
    assert wait_until(lambda: _running(server) == 0, 3), "requests ran on for nobody"


def test_other_clients_keep_their_requests(server):
    """Another client's connection ending leaves this one's stream running."""
    with Client(server.address, timeout=60) as keeper:
        stream = keeper.stream("Hello", max_tokens=300, ignore_eos=True)
        chunks = iter(stream)
        next(chunks)
        ctx = zmq.Context()
        other = ctx.socket(zmq.DEALER)
        other.connect(server.address)
        other.send(encode(GenerateRequest("x", prompt="Hi", params={"max_tokens": 5})))
        other.recv()
        other.close(linger=0)
        ctx.term()
        tokens = sum(len(c.token_ids) for c in chunks)
        assert tokens == 299
