"""Every socket of every process of a running server, fed garbage: random bytes,
truncated frames, and msgpack frames of every valid tag with random field values
(generated from the messages' own field declarations). No process dies, no KV slot
leaks, and the server answers a normal request afterwards.

Internal sockets are reached the way a local attacker with access to the private
ipc directory would: their addresses are read from the children's command lines.
"""

import math
import random
import time
import zlib
from pathlib import Path

import msgpack
import pytest
import zmq

from mlxd import Client, MlxdError
from mlxd import protocol
from mlxd.protocol.fields import Bool, Float, Int, List, Map, Opt, Str, Struct
from mlxd.protocol.message import wire_fields
from support import Server, connect_client, pid_alive, wait_until

FRAMES_PER_KIND = 600     # per socket: random bytes, truncated frames, random messages
TIME_LIMIT = 20.0         # seconds of fuzzing per socket at most
MESSAGES = [getattr(protocol, name) for name in protocol.__all__
            if hasattr(getattr(protocol, name), "TAG")]
INTERNAL = {   # the sockets a process binds, by the flag that names them, and a peer's kind
    "worker": [("--input-addr", zmq.PUSH)],
    "scheduler": [("--worker-output-addr", zmq.PUSH)],
    # the engines' ROUTER: garbage from a peer that is no joined engine, or joins as one
    "tokenizer": [("--engines-addr", zmq.DEALER)],
}


def random_value(kind, rng: random.Random, depth: int = 0):
    """Mostly plausible values (so that many frames decode and reach the logic behind
    the codec), sometimes edge values."""
    edge = rng.random() < 0.15
    if isinstance(kind, Opt):
        return None if rng.random() < 0.3 else random_value(kind.kind, rng, depth)
    if isinstance(kind, Int):
        if edge:
            return rng.choice([-1, rng.randrange(-2**40, 2**40), 2**63 - 1, 2**31])
        return rng.randrange(0, 64)
    if isinstance(kind, Float):
        return rng.choice([-1.0, 1e-300, 1e300, math.nan, math.inf]) if edge else rng.random()
    if isinstance(kind, Str):
        if kind.choices and not edge:
            return rng.choice(kind.choices)
        return rng.choice(["", "x", "é" * rng.randrange(1, 40)])
    if isinstance(kind, Bool):
        return rng.random() < 0.5
    if isinstance(kind, Map):
        return rng.choice([{}, {"a": 1}, {"x": [1, 2]}])
    if isinstance(kind, Struct):
        return random_fields(kind.cls, rng, depth + 1)
    if isinstance(kind, List):
        if depth > 3:
            return []
        item = kind.item
        return [random_value(item, rng, depth + 1) if item is not None
                else rng.choice([0, "x", None, 1.5]) for _ in range(rng.randrange(0, 6))]
    return rng.choice([0, "x", None, [], {}])


def random_fields(cls, rng: random.Random, depth: int = 0) -> list:
    return [random_value(kind, rng, depth) for kind in wire_fields(cls).values()]


def garbage_frames(rng: random.Random):
    """Random bytes, truncated valid-looking frames, random messages of every tag."""
    for _ in range(FRAMES_PER_KIND):
        yield rng.randbytes(rng.randrange(0, 64))
    for _ in range(FRAMES_PER_KIND):
        cls = rng.choice(MESSAGES)
        frame = msgpack.packb([cls.TAG, *random_fields(cls, rng)], use_bin_type=True)
        yield frame[:rng.randrange(0, len(frame))] if len(frame) > 1 else b""
    for _ in range(FRAMES_PER_KIND):
        cls = rng.choice(MESSAGES)
        yield msgpack.packb([cls.TAG, *random_fields(cls, rng)], use_bin_type=True)
    for _ in range(FRAMES_PER_KIND):   # messages that pass validation: the logic behind it
        yield valid_frame(rng.choice(MESSAGES), rng)


def valid_frame(cls, rng: random.Random) -> bytes:
    """A random message of `cls` that decodes (cross-field rules included)."""
    decoder = protocol.Decoder(cls)
    for _ in range(200):
        frame = msgpack.packb([cls.TAG, *random_fields(cls, rng)], use_bin_type=True)
        try:
            decoder.decode(frame)
            return frame
        except protocol.ProtocolError:
            continue
    return frame


def cmdline_flag(pid: int, flag: str) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return next(a.split("=", 1)[1] for a in argv if a.startswith(flag + "="))


@pytest.fixture(scope="module")
def server(llama_model):
    srv = Server(llama_model, "--kv-capacity", "4096", "--log-level", "error")
    yield srv
    srv.stop()


def _feed(ctx: zmq.Context, address: str, seed: int, kind: int) -> int:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    connect_client(sock, address)
    sent, deadline = 0, time.monotonic() + TIME_LIMIT
    for frame in garbage_frames(random.Random(seed)):
        if time.monotonic() > deadline:
            break
        sock.send(frame)
        sent += 1
    time.sleep(0.5)   # let them arrive before the socket goes
    sock.close()
    return sent


def _healthy(server: Server) -> None:
    assert server.proc.poll() is None, "\n".join(server.stderr_lines[-30:])
    for pid in server.child_pids:
        assert pid_alive(pid), "\n".join(server.stderr_lines[-30:])
    with Client(server.address, timeout=60) as c:
        # a fuzzed worker may fail the scheduler's next step once (its state was
        # tampered with); the one after must be served
        results = [c.generate("Hello there", max_tokens=8, ignore_eos=True) for _ in range(2)]
        assert results[-1].finish_reason == "length", results
        assert wait_until(lambda: c.stats()["running"] == 0 and c.stats()["waiting"] == 0, 60)
        stats = c.stats()
        assert stats["used_slots"] == 0, stats
        assert stats["free_slots"] + stats["cached_slots"] == stats["capacity"], stats
        # pins the fuzzed requests took stay within their bound and in the tree
        assert stats["pinned_slots"] <= min(stats["max_pinned_slots"],
                                            stats["cached_slots"]), stats


@pytest.mark.parametrize("process", sorted(INTERNAL))
def test_internal_sockets_survive_garbage(server, process):
    ctx = zmq.Context()
    try:
        pid = server.child(f"{process}_proc")
        for flag, kind in INTERNAL[process]:
            assert _feed(ctx, cmdline_flag(pid, flag), seed=_seed(process, flag),
                         kind=kind) > 0
        _healthy(server)
    finally:
        ctx.term()


def test_client_socket_survives_garbage(server):
    ctx = zmq.Context()
    try:
        assert _feed(ctx, server.address, seed=11, kind=zmq.DEALER) > 0
        _healthy(server)
    finally:
        ctx.term()


def random_cache_prefixes(rng: random.Random):
    """A `cache_prefixes` parameter, mostly malformed: wrong types, missing keys, bad
    ttls, too many entries, messages the template refuses, tools of no shape."""
    chat = [{"role": "user", "content": "Hello"}]
    entry = {"messages": chat, "ttl": 300}
    return rng.choice([
        None, 0, "x", {}, [], [entry] * rng.randrange(0, 9), [{}], [{"messages": chat}],
        [{**entry, "ttl": rng.choice([0, -1, 1.5, "5m", None, 10**9, True])}],
        [{**entry, "messages": rng.choice([[], "x", [1], [{"role": 3}], None])}],
        [{**entry, "tools": rng.choice([[{"x": 1}], "x", [{"type": "function"}], {}])}],
        [{**entry, "extra": 1}], [entry, {**entry, "messages": chat * 3}],
        [{**entry, "messages": [{"role": "tool", "content": rng.randbytes(8).hex()}]}],
    ])


def test_cache_prefixes_garbage_is_refused_or_served(server):
    rng = random.Random(26)
    outcomes = set()
    with Client(server.address, timeout=60) as c:
        for _ in range(60):
            params = {"cache_prefixes": random_cache_prefixes(rng)}
            try:
                result = c.generate(messages=[{"role": "user", "content": "Hello there"}],
                                    max_tokens=2, **params)
                assert result.finish_reason in ("stop", "length"), result
                outcomes.add("served")
            except MlxdError as exc:
                assert exc.code == "invalid_request" and exc.param == "cache_prefixes", exc
                outcomes.add("refused")
        assert outcomes == {"served", "refused"} and c.stats()["pinned_slots"] > 0
    _healthy(server)


def _seed(process: str, flag: str) -> int:
    return zlib.crc32(f"{process} {flag}".encode())


