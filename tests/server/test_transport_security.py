"""The client socket: CURVE by default, --api-key, and clients that pick their own
ZeroMQ routing ids. Real servers on loopback."""

import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from mlxd import Client, MlxdError
from mlxd.protocol import AbortRequest, GenerateRequest, StatsRequest, encode
from mlxd.runtime import keys
from support import PROMPTS, RawDealer, Server, connect_client, pid_alive

SECRET_PROMPT = "the launch codes are zebra-kumquat-4711"


@pytest.fixture(scope="module")
def server(llama_model):
    srv = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning")
    yield srv
    srv.stop()


def _alive(server: Server) -> None:
    assert server.proc.poll() is None, "\n".join(server.stderr_lines[-30:])
    for pid in server.child_pids:
        assert pid_alive(pid), "\n".join(server.stderr_lines[-30:])


# ---- defect: clients that claim the routing ids the server hands out next ----------

def _claim(ctx: zmq.Context, address: str, count: int) -> list[zmq.Socket]:
    """Connections that claim the ids an unseeded libzmq ROUTER gives out first
    (00 6b8b4567, counting up), each finishing its handshake with a request."""
    socks = []
    for k in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"\x00" + (0x6B8B4567 + k).to_bytes(4, "big"))
        connect_client(sock, address)
        sock.send(encode(StatsRequest(f"s{k}")))
        socks.append(sock)
    for sock in socks:
        assert sock.poll(15_000), "a claimant got no reply"
        sock.recv()
    return socks


def test_clients_claiming_the_next_routing_ids_crash_nothing(llama_model):
    srv = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning")
    ctx = zmq.Context()
    try:
        claimants = _claim(ctx, srv.address, 16)   # held open: their ids stay taken
        for _ in range(6):   # ordinary clients: each gets an id from the server
            with Client(srv.address, timeout=30) as client:
                assert client.generate(PROMPTS[0], max_tokens=3).finish_reason in (
                    "length", "stop")
        _alive(srv)
        assert all(not s.closed for s in claimants)
    finally:
        ctx.destroy(linger=0)
        srv.stop()


# ---- CURVE ----------------------------------------------------------------------------

def test_a_client_without_the_key_gets_nothing_and_costs_nothing(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)   # plain: no CURVE key
    try:
        for i in range(50):   # with no handshake done there may be no pipe to queue on
            try:
                sock.send(encode(GenerateRequest(f"x{i}", prompt="hi",
                                                 params={"max_tokens": 4})), zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.02)
        assert not sock.poll(1500), "a client without the server key got a reply"
    finally:
        sock.close(0)
        ctx.term()
    with Client(server.address, timeout=60) as client:
        stats = client.stats()
        assert stats["waiting"] == 0 and stats["running"] == 0
    _alive(server)


def test_the_sdk_says_why_a_server_refuses_it(server):
    with Client(server.address, timeout=60, server_key=keys.KeyPair.new().public) as c:
        with pytest.raises(MlxdError) as err:
            c.generate("hi", max_tokens=2)
    assert err.value.code == "unauthorized" and "key is wrong" in err.value.message


def test_the_sdk_without_a_key_is_told_to_get_one(server, monkeypatch, tmp_path):
    monkeypatch.setenv(keys.RUNTIME_ENV, str(tmp_path))   # finds no published key
    with Client(server.address, timeout=60) as c:
        with pytest.raises(MlxdError) as err:
            c.generate("hi", max_tokens=2)
    assert err.value.code == "unauthorized" and "server_key" in err.value.message


class _Tap:
    """A TCP relay that records every byte between a client and the server."""

    def __init__(self, address: str):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_prompts_and_outputs_cross_the_wire_encrypted(server):
    tap = _Tap(server.address)
    key = keys.server_key_for(server.address)
    try:
        with Client(tap.address, timeout=60, server_key=key) as client:
            result = client.generate(SECRET_PROMPT, max_tokens=8, ignore_eos=True)
        assert result.text and len(result.token_ids) == 8
        time.sleep(0.2)
        assert len(tap.seen) > 200
        assert b"zebra-kumquat" not in tap.seen
        assert result.text.encode() not in tap.seen
        assert b"max_tokens" not in tap.seen
    finally:
        tap.close()


def test_a_fixed_key_file_serves_clients_that_hold_its_public_key(llama_model, tmp_path,
                                                                  monkeypatch):
    key_file = tmp_path / "server.key"
    assert keys.main([str(key_file)]) == 0
    public = keys.read_secret_key(key_file).public
    srv = Server(llama_model, "--kv-capacity", "2048", "--log-level", "warning",
                 "--curve-secret-key", str(key_file))
    try:
        monkeypatch.setenv(keys.RUNTIME_ENV, str(tmp_path / "elsewhere"))   # no lookup
        with Client(srv.address, timeout=60, server_key=public.decode()) as client:
            assert client.generate("hi", max_tokens=2).finish_reason in ("length", "stop")
    finally:
        srv.stop()


def test_a_bad_key_file_stops_the_launcher_with_the_reason(llama_model, tmp_path):
    (tmp_path / "bad.key").write_text("nope")
    with pytest.raises(RuntimeError, match="curve-secret-key"):
        Server(llama_model, "--curve-secret-key", str(tmp_path / "bad.key"), ready_timeout=60)


# ---- --api-key --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(llama_model):
    import os

    env = {**os.environ, "MLXD_API_KEY": "k-9f2c"}
    srv = Server(llama_model, "--kv-capacity", "2048", "--log-level", "warning", env=env)
    yield srv
    srv.stop()


def test_requests_without_the_api_key_are_refused(keyed_server, monkeypatch):
    monkeypatch.delenv("MLXD_API_KEY", raising=False)
    for key in ("", "k-9f2d"):
        with Client(keyed_server.address, timeout=60, api_key=key) as client:
            with pytest.raises(MlxdError) as err:
                client.generate("hi", max_tokens=2)
            assert err.value.code == "unauthorized"
            with pytest.raises(MlxdError) as err:
                client.stats()
            assert err.value.code == "unauthorized"
    with Client(keyed_server.address, timeout=60, api_key="k-9f2c") as client:
        assert client.generate("hi", max_tokens=2).finish_reason in ("length", "stop")
        assert client.stats()["running"] == 0
    _alive(keyed_server)


def test_a_wrong_key_cannot_abort_anothers_request(keyed_server):
    with Client(keyed_server.address, timeout=60, api_key="k-9f2c") as client:
        stream = client.stream("hi", max_tokens=40, ignore_eos=True, rid="victim")
        next(stream)
        with RawDealer(keyed_server.address) as raw:
            raw.send(AbortRequest("victim", "wrong"))
            assert raw.recv().code == "unauthorized"
        chunks = list(stream)
        assert chunks[-1].finish_reason == "length"


def test_the_api_key_stays_off_every_command_line(keyed_server):
    """Given through MLXD_API_KEY, the key reaches the tokenizer without argv."""
    for pid in [keyed_server.proc.pid, *keyed_server.child_pids]:
        assert b"k-9f2c" not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_an_exposed_server_without_an_api_key_is_warned_about(caplog):
    from mlxd.launcher import warn_if_exposed
    from mlxd.runtime.flags import ServerFlags

    for host, http_host, api_key, warned in [
            ("127.0.0.1", "", "", False), ("0.0.0.0", "", "", True),
            ("0.0.0.0", "", "k", False), ("::1", "", "", False),
            ("127.0.0.1", "0.0.0.0", "", True), ("0.0.0.0", "localhost", "", True)]:
        caplog.clear()
        warn_if_exposed(ServerFlags(host=host, http_host=http_host, api_key=api_key))
        assert ("WARNING" in caplog.text) == warned, (host, http_host, api_key)
