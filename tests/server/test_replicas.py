"""Several engines behind one front end, through real processes on real sockets:
`--dp 2` replicas routed by cached prefix, a replica's scheduler killed under load,
and an engine on "another machine" (`mlxd engine --join`, over TCP with CURVE)."""

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from mlxd.client import AsyncClient, Client
from mlxd.launcher import ENGINE_PREFIX
from mlxd.protocol import SchedulerReady, encode
from mlxd.runtime.keys import read_secret_key
from support import (ROOT, Server, children_of, reference_tokens, send_raw_garbage, wait_until,
                     worker_limits)

MAX_TOKENS = 12
VOCAB = 500


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def engine_stats(address: str) -> dict:
    with Client(address, timeout=30) as c:
        return c.stats()


def scheduler_pid(server: Server, engine: str) -> int:
    """The pid of the scheduler process of `engine` (its command line names it)."""
    for pid in children_of(server.proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"mlxd.scheduler_proc" in cmdline and f"--engine={engine}".encode() in cmdline:
            return pid
    raise LookupError(engine)


def assert_exact(model: str, ids: list[int], result, max_tokens: int = MAX_TOKENS):
    ref = reference_tokens(model, ids, max_tokens)
    assert result.token_ids == [t for t, _ in ref]
    assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3


@pytest.fixture(scope="module")
def replicas(llama_model):
    server = Server(llama_model, "--dp", "2", "--kv-capacity", "4096",
                    "--speculative", "off", "--log-level", "warning")
    yield server
    server.stop()


def test_concurrent_requests_spread_over_both_replicas_and_match_mlx_lm(replicas,
                                                                        llama_model):
    prompts = [random_ids(20 + 7 * i, seed=i) for i in range(8)]
    before = engine_stats(replicas.address)["engines"]

    async def run():
        async with AsyncClient(replicas.address, timeout=60) as c:
            return await asyncio.gather(*(c.generate(input_ids=p, max_tokens=MAX_TOKENS,
                                                     logprobs=True) for p in prompts))

    results = asyncio.run(run())
    for ids, result in zip(prompts, results):
        assert_exact(llama_model, ids, result)
    after = engine_stats(replicas.address)
    assert sorted(after["engines"]) == ["engine0", "engine1"]
    routed = [after["engines"][e]["routed"] - before[e]["routed"] for e in sorted(before)]
    assert all(n > 0 for n in routed) and sum(routed) == len(prompts), routed
    assert after["router"]["engines_up"] == 2


def conversation_turns(address: str, conversations: int = 20, turns: int = 3) -> list:
    """Run `conversations` concurrent chats of `turns` turns, each turn's prompt the
    last prompt, its reply and a new message; (previous prompt length, cached tokens)
    of every follow-up turn."""

    async def chat(c, seed):
        prompt, out = random_ids(40, seed), []
        for turn in range(turns):
            result = await c.generate(input_ids=prompt, max_tokens=8, ignore_eos=True)
            if turn:
                out.append((previous, result.usage["cached_tokens"]))
            previous = len(prompt)
            prompt = prompt + result.token_ids + random_ids(10, seed * 100 + turn)
        return out

    async def run():
        async with AsyncClient(address, timeout=120) as c:
            return await asyncio.gather(*(chat(c, 1000 + s) for s in range(conversations)))

    return [pair for pairs in asyncio.run(run()) for pair in pairs]


@pytest.mark.parametrize("policy", ["cache", "round_robin"])
def test_follow_up_turns_land_on_the_replica_holding_their_prefix(policy, llama_model):
    server = Server(llama_model, "--dp", "2", "--kv-capacity", "4096", "--speculative",
                    "off", "--route-policy", policy, "--log-level", "warning")
    try:
        follow_ups = conversation_turns(server.address)
        stats = engine_stats(server.address)
    finally:
        server.stop()
    hits = sum(cached >= previous for previous, cached in follow_ups) / len(follow_ups)
    if policy == "cache":
        assert hits >= 0.95, (hits, follow_ups)
        assert stats["router"]["decisions"].get("cache", 0) >= 0.95 * len(follow_ups)
    else:   # the comparison: round-robin sends half of them to the other replica
        assert hits <= 0.75, (hits, follow_ups)


def test_a_killed_replica_s_requests_rerun_or_resume_and_it_comes_back(llama_model):
    server = Server(llama_model, "--dp", "2", "--kv-capacity", "4096", "--speculative",
                    "off", "--max-running-requests", "2", "--log-level", "warning")
    try:
        _kill_one_replica_under_load(server, llama_model)
    finally:
        server.stop()


def _kill_one_replica_under_load(server: Server, llama_model: str) -> None:
    prompts = [random_ids(16, seed=50 + i) for i in range(8)]
    with Client(server.address, timeout=120) as c:
        # each replica runs 2 and queues 2: the queued ones have streamed nothing
        streams = [c.stream(input_ids=p, max_tokens=3000, ignore_eos=True) for p in prompts[:4]]
        for s in streams:
            next(s)
        waiting = [c.stream(input_ids=p, max_tokens=MAX_TOKENS, logprobs=True)
                   for p in prompts[4:]]
        assert wait_until(lambda: c.stats()["waiting"] == 4, 10), c.stats()
        os.kill(scheduler_pid(server, "engine1"), signal.SIGKILL)
        # the streams of the dead replica resume on engine0 (test_resume.py checks
        # their tokens); every stream is aborted after 200 chunks
        for s in streams:
            chunks = list(_until_finished(s, after=200))
            assert chunks[-1].finish_reason == "abort", chunks[-1]
        # the queued ones: run again on engine0, whole and exact
        for ids, s in zip(prompts[4:], waiting):
            chunks = list(s)
            assert chunks[-1].finish_reason == "length", chunks[-1]
            tokens = [t for ch in chunks for t in ch.token_ids]
            logprobs = [lp for ch in chunks for lp in (ch.logprobs or [])]
            ref = reference_tokens(llama_model, ids, MAX_TOKENS)
            assert tokens == [t for t, _ in ref]
            assert max(abs(a - b) for a, (_, b) in zip(logprobs, ref)) < 1e-3
        # engine1 is restarted and joins again; nothing leaked anywhere
        assert wait_until(lambda: c.stats()["router"]["engines_up"] == 2, 60), c.stats()
        stats = c.stats()
        assert stats["router"]["losses"] == 1 and stats["router"]["reruns"] == 2
        assert stats["router"]["resumes"] == 2
        for name, engine in stats["engines"].items():
            assert engine["running"] == engine["waiting"] == engine["used_slots"] == 0, name
            assert engine["free_slots"] + engine["cached_slots"] == engine["capacity"]
        result = c.generate(input_ids=prompts[0], max_tokens=MAX_TOKENS, logprobs=True)
        assert_exact(llama_model, prompts[0], result)


def _until_finished(stream, after: int):
    """A long stream's chunks; it is aborted after `after` chunks if still running."""
    for i, chunk in enumerate(stream):
        yield chunk
        if chunk.finish_reason:
            return
        if i == after:
            stream.abort()


def _new_key_file(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(path)], check=True,
                   cwd=ROOT, capture_output=True)
    return path


def _impostor_joins(address: str, server_key: bytes, limits) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"impostor")
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
    sock.connect(address)
    sock.send(encode(SchedulerReady(limits, 64)))
    time.sleep(1)
    sock.close()
    ctx.term()


def test_an_engine_joins_over_tcp_with_the_key_and_one_without_it_is_refused(
        llama_model, tmp_path):
    key = _new_key_file(tmp_path / "front.key")
    front = Server(llama_model, "--engine-port", "0", "--curve-secret-key", str(key),
                   "--kv-capacity", "4096", "--speculative", "off", "--log-level", "info")
    engines = []
    try:
        join = front.addresses[ENGINE_PREFIX]
        assert join.startswith("tcp://127.0.0.1:")
        engines.append(Server(llama_model, "--join", join, "--engine-name", "remote",
                              "--curve-secret-key", str(key), "--kv-capacity", "4096",
                              command=[sys.executable, str(ROOT / "launch.py"), "engine"]))
        assert wait_until(lambda: engine_stats(front.address)["router"]["engines_up"] == 2,
                          30)
        prompts = [random_ids(30, seed=300 + i) for i in range(6)]

        async def run():
            async with AsyncClient(front.address, timeout=60) as c:
                return await asyncio.gather(*(c.generate(
                    input_ids=p, max_tokens=MAX_TOKENS, logprobs=True) for p in prompts))

        for ids, result in zip(prompts, asyncio.run(run())):
            assert_exact(llama_model, ids, result)
        assert engine_stats(front.address)["engines"]["remote"]["routed"] > 0

        # an engine with another key file: its handshake fails, it never joins
        intruder = Server(llama_model, "--join", join, "--engine-name", "intruder",
                          "--curve-secret-key", str(_new_key_file(tmp_path / "other.key")),
                          "--kv-capacity", "4096",
                          command=[sys.executable, str(ROOT / "launch.py"), "engine"])
        engines.append(intruder)
        # a peer that knows the front end's public key but not its secret one: refused
        # by the authenticator, its SchedulerReady never read
        _impostor_joins(join, read_secret_key(key).public, worker_limits(4096, 8192))
        assert wait_until(lambda: any("refused an engine connection" in line
                                      for line in front.stderr_lines), 30)
        stats = engine_stats(front.address)
        assert sorted(stats["engines"]) == ["engine0", "remote"]
        assert stats["router"]["joins"] == 2
        assert not [line for line in front.stderr_lines if "impostor" in line]   # never read
        # raw bytes at the engine port (no handshake, a huge one, a peer that vanishes)
        send_raw_garbage(join)
        assert front.proc.poll() is None
        with Client(front.address, timeout=60) as c:
            result = c.generate(input_ids=prompts[0], max_tokens=MAX_TOKENS, logprobs=True)
            assert sorted(c.stats()["engines"]) == ["engine0", "remote"]
        assert_exact(llama_model, prompts[0], result)
        assert intruder.proc.poll() is None   # it keeps trying; nothing of it got in
    finally:
        for engine in engines:
            engine.stop()
        front.stop()


def test_metrics_and_stats_per_engine(replicas):
    import httpx

    with Client(replicas.address, timeout=30) as c:
        c.generate(input_ids=random_ids(20, seed=77), max_tokens=4)
        stats = c.stats()
    assert stats["capacity"] == sum(e["capacity"] for e in stats["engines"].values())
    text = httpx.get(f"{replicas.http_url}/metrics", timeout=30).text
    model = httpx.get(f"{replicas.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
    for engine in ("engine0", "engine1"):
        labels = f'engine="{engine}",model="{model}"'
        assert f'mlxd_engine_kv_slots_capacity{{{labels}}} 4096.0' in text
        assert f'mlxd_engine_routed_total{{{labels}}}' in text
    assert f'mlxd_router_decisions_total{{model="{model}",reason="load"}}' in text
    assert f'mlxd_engines_up{{model="{model}"}} 2.0' in text
    assert f'mlxd_model_kv_slots_capacity{{model="{model}"}} 8192.0' in text
    assert f'mlxd_model_state{{model="{model}",state="loaded"}} 1.0' in text


def test_openai_client_choices_share_a_replica(replicas, llama_model):
    import openai

    before = engine_stats(replicas.address)
    client = openai.OpenAI(base_url=f"{replicas.http_url}/v1", api_key="none")
    prompt = random_ids(24, seed=91)
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                      max_tokens=MAX_TOKENS, n=3, temperature=0)
    ref = [t for t, _ in reference_tokens(llama_model, prompt, MAX_TOKENS)]
    assert len(reply.choices) == 3
    after = engine_stats(replicas.address)
    routed = {e: after["engines"][e]["routed"] - before["engines"][e]["routed"]
              for e in after["engines"]}
    assert sorted(routed.values()) == [0, 3], routed   # all three choices on one engine
    decisions = after["router"]["decisions"]
    assert decisions["affinity"] - before["router"]["decisions"].get("affinity", 0) == 2
    with Client(replicas.address, timeout=30) as c:
        text = c.generate(input_ids=prompt, max_tokens=MAX_TOKENS).text
    assert all(choice.text == text for choice in reply.choices) and ref
