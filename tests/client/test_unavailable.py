"""With no server to talk to, calls fail fast ("unavailable") instead of waiting out
their timeout; a server that comes back on the same address serves later calls."""

import asyncio
import socket
import threading

import pytest

from mlxd.client import AsyncClient, Client, MlxdError
from support import Server

BOUND_S = 30   # far below the clients' timeout, far above the expected time to fail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call_bounded(fn):
    """fn()'s exception (None if it returned); fails the test if fn is still waiting
    after BOUND_S."""
    outcome = {}

    def run():
        try:
            fn()
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert "error" in outcome, "the call still waits"
    return outcome["error"]


def test_nothing_listening_fails_fast():
    with Client(f"tcp://127.0.0.1:{free_port()}", timeout=600) as client:
        for call in (lambda: client.generate("Hello", max_tokens=2), client.stats,
                     lambda: next(client.stream("Hello", max_tokens=2))):
            error = call_bounded(call)
            assert isinstance(error, MlxdError) and error.code == "unavailable"


def test_nothing_listening_fails_fast_async():
    async def main():
        async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout=600) as client:
            with pytest.raises(MlxdError) as err:
                await asyncio.wait_for(client.generate("Hello"), BOUND_S)
            return err.value.code

    assert asyncio.run(main()) == "unavailable"


def test_a_stopped_server_fails_fast_and_a_restarted_one_serves(llama_model):
    port = str(free_port())
    flags = ("--port", port, "--kv-capacity", "4096", "--log-level", "warning")
    server = Server(llama_model, *flags)
    try:
        with Client(server.address, timeout=600) as client:
            stream = client.stream("Hello", max_tokens=2000, ignore_eos=True)
            next(stream)
            server.stop()
            outcome = {}

            def read():
                try:
                    outcome["chunks"] = list(stream)
                except MlxdError as exc:
                    outcome["error"] = exc

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(BOUND_S)
            # the connection drops, or (the engine went first) the request ends in error
            assert outcome, "the stream still waits"
            if "error" in outcome:
                assert outcome["error"].code == "disconnected"
            else:
                assert outcome["chunks"][-1].finish_reason == "error"
            error = call_bounded(lambda: client.generate("Hello", max_tokens=2))
            assert isinstance(error, MlxdError) and error.code == "unavailable"
            server = Server(llama_model, *flags)
            result = client.generate("Hello", max_tokens=2)
            assert result.finish_reason in ("length", "stop")
    finally:
        server.stop()
