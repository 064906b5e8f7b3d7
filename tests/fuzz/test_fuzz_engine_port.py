"""The front end's TCP engine port (`--engine-port`: a CURVE server admitting only the
holder of the front end's own key pair), fed what the client socket is fed.

Peers without the key: raw bytes, a handshake frame announced as 1 GiB, slow
greetings, a CURVE client with a key of its own; none is read, none costs memory.
Insiders (holding the key, as an engine does): garbage msgpack and messages of every
tag, messages of other sockets, frames over the cap, a peer that vanishes mid-message
or crawls; each is logged and dropped, the process lives, and the server serves a real
request after. An engine that stops (SIGSTOP: its machine hangs) is taken out within
ZeroMQ's heartbeat timeout (4 s), inside --worker-timeout, and joins again when it
wakes.
"""

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from mlxd import Client
from mlxd.client import AsyncClient
from mlxd.launcher import ENGINE_PREFIX
from mlxd.protocol import (
    GenerateRequest, SamplingParams, SchedulerReady, Step, TokenBatch, TokenizedRequest,
    WorkerLimits, encode,
)
from mlxd.protocol.codec import MAX_FRAME_BYTES
from mlxd.protocol.message import wire_fields
from mlxd.runtime.keys import read_secret_key
from mlxd.runtime.sockets import HEARTBEAT_TIMEOUT_MS
from fuzz_support import Insider, Relay, huge_handshake, rss_mib, slow_raw_peers
from support import ROOT, Server, send_raw_garbage, wait_until
from test_fuzz_sockets import garbage_frames

FUZZ_SECONDS = 8.0
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-port") / "front.key"
    subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(path)], check=True,
                   cwd=ROOT, capture_output=True)
    return path


@pytest.fixture(scope="module")
def front(llama_model, key):
    srv = Server(llama_model, "--engine-port", "0", "--curve-secret-key", str(key),
                 "--kv-capacity", "4096", "--speculative", "off", "--log-level", "info")
    yield srv
    srv.stop()


def join_address(front: Server) -> str:
    return front.addresses[ENGINE_PREFIX]


def logged(front: Server, text: str, seconds: float = 15) -> bool:
    return wait_until(lambda: any(text in line for line in front.stderr_lines), seconds)


def serves(front: Server) -> None:
    """Every process is up, only the server's own engine is joined, and a real
    request through the SDK is served in full."""
    assert front.proc.poll() is None, "\n".join(front.stderr_lines[-30:])
    with Client(front.address, timeout=60) as c:
        result = c.generate(input_ids=PROMPT, max_tokens=8, ignore_eos=True)
        assert result.finish_reason == "length", result
        assert wait_until(lambda: sorted(c.stats()["engines"]) == ["engine0"], 15)


def engine_limits(front: Server) -> WorkerLimits:
    """The limits the server's own engine reported: an engine stating them joins."""
    with Client(front.address, timeout=60) as c:
        worker = c.stats()["engines"]["engine0"]["worker"]
    return WorkerLimits(**{name: worker[name] for name in wire_fields(WorkerLimits)})


def test_peers_without_the_key_are_never_read(front, key):
    """A 1 GiB handshake frame is refused at its size (nothing buffered), raw bytes
    and slow greetings cost a connection each, and a CURVE client with another key is
    refused by the authenticator: no frame of any reaches the front end."""
    tokenizer, seen = front.child("tokenizer_proc"), len(front.stderr_lines)
    taken, grew = huge_handshake(join_address(front), tokenizer)
    assert taken < 16 << 20 and grew < 16, (taken, grew)
    send_raw_garbage(join_address(front))
    crawlers = threading.Thread(target=slow_raw_peers, args=(join_address(front), 20, 4.0))
    crawlers.start()
    started = time.monotonic()
    serves(front)   # while 20 peers crawl through their greetings
    assert time.monotonic() - started < 15
    crawlers.join()

    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
    stranger.curve_serverkey = read_secret_key(key).public
    stranger.connect(join_address(front))
    for frame in (b"garbage", bytes(MAX_FRAME_BYTES + 1)):
        try:
            stranger.send(frame, zmq.NOBLOCK)
        except zmq.Again:   # never admitted: no pipe to queue on
            pass
    assert logged(front, "refused an engine connection")
    stranger.close()
    ctx.term()
    assert not any("from the engine" in line for line in front.stderr_lines[seen:])
    serves(front)


def test_an_insider_s_garbage_and_wrong_tags_are_logged_and_dropped(front, key):
    insider = Insider(zmq.DEALER, join_address(front), read_secret_key(key), b"insider")
    try:
        deadline = time.monotonic() + FUZZ_SECONDS
        for frame in garbage_frames(random.Random(17)):
            if time.monotonic() > deadline:
                break
            insider.send(frame)
        for msg in (GenerateRequest("x", prompt="hi"), Step(1),   # other sockets' messages
                    TokenizedRequest(1, [1], SamplingParams(), 4)):
            insider.send(encode(msg))
        insider.sock.send_multipart([b"two", b"frames"])
        assert logged(front, "dropped a malformed frame from the engine insider")
        assert logged(front, "unexpected message tag")
        assert logged(front, "dropped an engine message of 2 frames")
    finally:
        insider.close()
    serves(front)


def test_an_insider_s_frame_over_the_cap_ends_its_link_unread(front, key):
    """The protocol's largest frame is read (and refused as malformed); one byte more
    and ZeroMQ drops the link at the frame's size, buffering none of it."""
    tokenizer = front.child("tokenizer_proc")
    insider = Insider(zmq.DEALER, join_address(front), read_secret_key(key), b"big")
    try:
        insider.send(bytes(MAX_FRAME_BYTES))   # msgpack 0, then extra data
        assert logged(front, "dropped a malformed frame from the engine big")
        assert not insider.dropped(1)
        before = rss_mib(tokenizer)
        insider.send(bytes(MAX_FRAME_BYTES + 1))
        assert insider.dropped()
        assert rss_mib(tokenizer) - before < 32
    finally:
        insider.close()
    serves(front)


def test_an_insider_that_vanishes_mid_message_is_lost(front, key):
    """An insider joins as an engine (it states the right limits), then vanishes 1 MiB
    into an 8 MiB batch: its link's end takes it out of the engine set."""
    relay = Relay(join_address(front), cut_after=1 << 20)
    insider = Insider(zmq.DEALER, relay.address, read_secret_key(key), b"vanisher")
    try:
        insider.send(encode(SchedulerReady(engine_limits(front), 4)))
        # joined (the log says so: a stats query would wait for its answer)
        assert logged(front, "engine vanisher of model")
        hashes = list(range(2**62, 2**62 + (1 << 20)))
        insider.send(encode(TokenBatch([], cache_stored=hashes)))
        assert relay.cut.wait(15)
        assert logged(front, "was lost") and any(
            "engine vanisher of model" in line and "was lost" in line
            for line in front.stderr_lines)
    finally:
        insider.close()
        relay.close()
    serves(front)


def test_a_slow_insider_holds_up_no_one(front, key):
    """An insider trickling a frame at 32 KiB/s: requests are served meanwhile as
    fast as ever; it then vanishes mid-frame."""
    relay = Relay(join_address(front), rate=32 << 10)
    insider = Insider(zmq.DEALER, relay.address, read_secret_key(key), b"crawler")
    try:
        insider.send(random.Random(3).randbytes(1 << 20))
        time.sleep(1)
        started = time.monotonic()
        serves(front)
        assert time.monotonic() - started < 15
        assert relay.passed < 1 << 20   # served while its frame was still arriving
    finally:
        relay.close()
        insider.close()
    serves(front)


def run_four(address: str) -> list:
    async def run():
        async with AsyncClient(address, timeout=60) as c:
            return await asyncio.gather(*(c.generate(
                input_ids=PROMPT + [i], max_tokens=8, ignore_eos=True) for i in range(4)))
    return asyncio.run(run())


def test_a_stopped_engine_is_taken_out_within_the_heartbeat_and_rejoins(llama_model, key,
                                                                        front):
    """A remote engine whose machine hangs (every process SIGSTOPped): requests
    sent after are served by the server's own engine (those routed to the stopped one
    run again), it is taken out within ZeroMQ's heartbeat timeout (4 s, inside any
    --worker-timeout), and joins again when it wakes."""
    remote = Server(llama_model, "--join", join_address(front), "--engine-name", "remote",
                    "--curve-secret-key", str(key), "--kv-capacity", "4096",
                    "--speculative", "off",
                    command=[sys.executable, str(ROOT / "launch.py"), "engine"])
    group = os.getpgid(remote.proc.pid)
    try:
        with Client(front.address, timeout=60) as c:
            assert wait_until(lambda: sorted(c.stats()["engines"]) == ["engine0", "remote"],
                              30)
        os.killpg(group, signal.SIGSTOP)
        stopped = time.monotonic()
        results = []
        load = threading.Thread(target=lambda: results.extend(run_four(front.address)))
        load.start()
        with Client(front.address, timeout=60) as c:
            assert wait_until(lambda: sorted(c.stats()["engines"]) == ["engine0"], 15)
        took = time.monotonic() - stopped
        assert took < HEARTBEAT_TIMEOUT_MS / 1000 + 3, took
        load.join(60)
        assert [r.finish_reason for r in results] == ["length"] * 4, results
        assert any("engine remote of model" in line and "was lost" in line
                   for line in front.stderr_lines)
        os.killpg(group, signal.SIGCONT)
        with Client(front.address, timeout=60) as c:
            assert wait_until(lambda: "remote" in c.stats()["engines"], 60, 0.5)
            result = c.generate(input_ids=PROMPT, max_tokens=8, ignore_eos=True)
            assert result.finish_reason == "length"
    finally:
        os.killpg(group, signal.SIGCONT)
        remote.stop()
    serves(front)
