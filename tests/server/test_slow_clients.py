"""A client that does not read its replies: its queue fills, its requests end with an
error it sees, every request's finish chunk arrives (never dropped), and the KV is
freed. Other clients are not held up."""

import time

import pytest
import zmq

from mlxd import Client
from mlxd.protocol import Decoder, ErrorReply, GenerateRequest, StreamChunk, encode
from support import Server, connect_client, requests_in_server, wait_until

STREAMS = 64
QUEUE_LIMIT = 50
MAX_TOKENS = 1500   # 64 x (prompt + 1500) fit the pool below


@pytest.fixture(scope="module")
def server(llama_model):
    # a pool that holds every stream to its end: no request ends for lack of memory
    srv = Server(llama_model, "--kv-capacity", "131072", "--client-queue-limit",
                 str(QUEUE_LIMIT), "--log-level", "error")
    yield srv
    srv.stop()


def test_a_client_that_does_not_read_gets_every_finish(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.setsockopt(zmq.RCVBUF, 4096)   # little room in the kernel either
    connect_client(sock, server.address)
    try:
        for i in range(STREAMS):
            sock.send(encode(GenerateRequest(f"r{i}", prompt="Once upon a time", stream=True,
                                             params={"max_tokens": MAX_TOKENS,
                                                     "ignore_eos": True})))
        # not reading: the server must end these requests by itself
        assert wait_until(lambda: requests_in_server(server.address) == 0, 60), "requests ran on for nobody"
        with Client(server.address, timeout=30) as other:   # others are served meanwhile
            assert other.generate("Hello", max_tokens=4).finish_reason == "length"
        finishes, decoder = {}, Decoder(StreamChunk, ErrorReply)
        deadline = time.monotonic() + 60
        while len(finishes) < STREAMS and time.monotonic() < deadline:
            if sock.poll(1000):
                msg = decoder.decode(sock.recv())
                if isinstance(msg, StreamChunk) and msg.finish_reason is not None:
                    finishes[msg.rid] = msg
        assert len(finishes) == STREAMS, f"finish chunks lost: {STREAMS - len(finishes)}"
        errors = [m for m in finishes.values() if m.finish_reason == "error"]
        assert errors and all("fell behind" in m.error for m in errors), errors
        assert all(m.usage is not None for m in finishes.values())
    finally:
        sock.close(linger=0)
        ctx.term()
    with Client(server.address, timeout=30) as c:
        assert c.stats()["used_slots"] == 0
