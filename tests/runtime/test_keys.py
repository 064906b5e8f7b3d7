"""CURVE keys: parsing, the user's default key, publishing for local clients."""

import os
import stat
import subprocess
import sys

import pytest
import zmq

from mlxd.runtime import keys


@pytest.fixture(autouse=True)
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv(keys.RUNTIME_ENV, str(tmp_path / "run"))
    monkeypatch.delenv(keys.SERVER_KEY_ENV, raising=False)
    return tmp_path / "run"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_keys_parse_and_bad_ones_are_refused_with_the_reason():
    pair = keys.KeyPair.new()
    assert keys.parse_key(pair.public.decode() + "\n") == pair.public
    assert keys.KeyPair.from_secret(pair.secret) == pair
    with pytest.raises(keys.BadKey, match="40 Z85 characters"):
        keys.parse_key("short")
    with pytest.raises(keys.BadKey, match="Z85"):
        keys.parse_key("~" * 40)


def test_the_default_key_is_made_once_and_private(runtime):
    path = keys.default_key_file()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    first = keys.read_secret_key(path)
    assert keys.read_secret_key(keys.default_key_file()) == first   # kept across starts


def test_an_unreadable_or_malformed_key_file_is_named(tmp_path):
    with pytest.raises(keys.BadKey, match="cannot read"):
        keys.read_secret_key(tmp_path / "missing")
    (tmp_path / "bad").write_text("not a key")
    with pytest.raises(keys.BadKey, match="bad"):
        keys.read_secret_key(tmp_path / "bad")


def test_a_local_client_finds_a_live_servers_key_by_port():
    pair = keys.KeyPair.new()
    path = keys.publish(5555, pair, os.getpid())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert keys.server_key_for("tcp://127.0.0.1:5555") == pair.public
    assert keys.server_key_for("tcp://localhost:5555") == pair.public
    assert keys.server_key_for("tcp://127.0.0.1:5556") is None
    assert keys.server_key_for("tcp://10.1.2.3:5555") is None   # not this machine
    keys.unpublish(5555, os.getpid() + 1)   # someone else's: kept
    assert keys.local_server_key(5555) == pair.public
    keys.unpublish(5555, os.getpid())
    assert keys.local_server_key(5555) is None


def test_a_dead_servers_record_is_ignored():
    keys.publish(5557, keys.KeyPair.new(), _dead_pid())
    assert keys.local_server_key(5557) is None


def test_a_given_key_wins_then_the_environment(monkeypatch):
    given, env = keys.KeyPair.new(), keys.KeyPair.new()
    keys.publish(5558, keys.KeyPair.new(), os.getpid())
    monkeypatch.setenv(keys.SERVER_KEY_ENV, env.public.decode())
    assert keys.server_key_for("tcp://127.0.0.1:5558", given.public) == given.public
    assert keys.server_key_for("tcp://127.0.0.1:5558") == env.public


def test_the_key_tool_writes_a_private_key_and_prints_its_public_half(tmp_path):
    path = tmp_path / "server.key"
    out = subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(path)],
                         capture_output=True, text=True, check=True).stdout
    pair = keys.read_secret_key(path)
    assert pair.public.decode() in out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(path)],
                           capture_output=True, text=True)
    assert again.returncode == 1 and keys.read_secret_key(path) == pair   # never overwritten


FIRST_ROUTING_ID = """
import zmq
from mlxd.runtime.keys import randomize_routing_ids
randomize_routing_ids()
ctx = zmq.Context()
router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
port = router.bind_to_random_port("tcp://127.0.0.1")
dealer.connect(f"tcp://127.0.0.1:{port}")
dealer.send(b"x")
print(router.recv_multipart()[0].hex())
"""


def test_routing_ids_start_somewhere_new_in_every_process():
    """libzmq counts a ROUTER's routing ids up from rand(): unseeded, every process
    hands out the same ids, which a client can claim ahead of others."""
    ids = {subprocess.run([sys.executable, "-c", FIRST_ROUTING_ID], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip() for _ in range(3)}
    assert len(ids) == 3, ids
