"""What the worker-group tests share (`--tp` and `--pp`): prompts, exactness against
mlx_lm, the live ranks of a server, and the lost-rank drill."""

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from mlxd.client import AsyncClient, Client
from support import (
    ROOT, Server, assert_same_stream, children_of, reference_tokens, wait_until,
)

MAX_TOKENS = 12


def prompts(n: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]


def assert_exact(model: str, ids: list[int], result, max_tokens: int = MAX_TOKENS):
    ref = reference_tokens(model, ids, max_tokens)
    assert result.token_ids == [t for t, _ in ref]
    assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3


def rank_pids(server: Server) -> dict[int, int]:
    """rank -> pid of the live worker ranks."""
    found = {}
    for pid in children_of(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mlxd.worker_proc" in cmdline:
            rank = next((int(a.split(b"=")[1]) for a in cmdline if a.startswith(b"--rank=")), 0)
            found[rank] = pid
    return found


def run_all(address: str, batch: list[list[int]], max_tokens: int = MAX_TOKENS, **params):
    async def run():
        async with AsyncClient(address, timeout=120) as c:
            return await asyncio.gather(*(c.generate(
                input_ids=p, max_tokens=max_tokens, logprobs=True, **params) for p in batch),
                return_exceptions=True)
    return asyncio.run(run())


def serves_exactly(server: Server, model: str) -> dict:
    """A 2-rank group serves exactly as mlx_lm: 12 concurrent requests, one alone, a
    prefix hit, a 700-token chunked prompt. Its worker stats."""
    assert sorted(rank_pids(server)) == [0, 1]
    batch = prompts(12)
    for ids, result in zip(batch, run_all(server.address, batch)):
        assert_exact(model, ids, result)
    with Client(server.address, timeout=120) as c:
        alone = c.generate(input_ids=batch[0], max_tokens=MAX_TOKENS, logprobs=True)
        again = c.generate(input_ids=batch[0] + [7, 8], max_tokens=MAX_TOKENS, logprobs=True)
        long_ids = prompts(1, length=700, seed=9)[0]   # chunked (512 a step)
        chunked = c.generate(input_ids=long_ids, max_tokens=MAX_TOKENS, logprobs=True)
        worker = c.stats()["worker"]
    assert_exact(model, batch[0], alone)
    assert again.usage["cached_tokens"] >= 16   # the prefix came from the pool
    assert_exact(model, batch[0] + [7, 8], again)
    assert_exact(model, long_ids, chunked)
    return worker


def lose_a_rank(model: str, how: str, *split: str) -> None:
    """SIGKILL or SIGSTOP rank 1 of a 2-rank group under load: every request resumes
    on the new group and completes with the tokens of an undisturbed run (up to a
    tie: support.assert_same_stream), the group comes back with new
    processes, and the next greedy request is exact."""
    server = Server(model, *split, "--kv-capacity", "4096", "--speculative", "off",
                    "--worker-timeout", "3", "--log-level", "warning")
    try:
        before = rank_pids(server)
        batch = prompts(6, seed=11)
        undisturbed = run_all(server.address, batch, max_tokens=400, ignore_eos=True)

        async def run():
            async with AsyncClient(server.address, timeout=60) as c:
                jobs = [asyncio.ensure_future(c.generate(input_ids=p, max_tokens=400,
                                                         ignore_eos=True, logprobs=True)) for p in batch]
                await asyncio.sleep(0.5)
                os.kill(before[1], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                return await asyncio.gather(*jobs, return_exceptions=True)

        results = asyncio.run(run())
        for result, want in zip(results, undisturbed):
            assert getattr(result, "finish_reason", None) == "length", result
            assert_same_stream(result.token_ids, result.logprobs, want.token_ids,
                               want.logprobs)
        assert wait_until(lambda: set(rank_pids(server).values()).isdisjoint(before.values())
                          and len(rank_pids(server)) == 2, 60)
        ids = prompts(1, seed=12)[0]
        with Client(server.address, timeout=120) as c:
            assert wait_until(lambda: c.stats().get("worker_status") != "restarting", 60)
            assert_exact(model, ids, c.generate(input_ids=ids, max_tokens=MAX_TOKENS,
                                                logprobs=True))
    finally:
        for pid in rank_pids(server).values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()


def refused_at_start(*args: str) -> str:
    """The launcher's stderr for a command line it must refuse, having left no
    process behind."""
    before = set(children_of(os.getpid()))
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args, "--port", "0",
                           "--http-port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr[-2000:]
    assert set(children_of(os.getpid())) <= before
    return done.stderr


@contextlib.contextmanager
def hostfile_group(model: str, folder: Path, *split: str):
    """(server, `mlxd rank` process, rank 1's Step address): a 2-host `--hostfile`
    group, both hosts 127.0.0.1: rank 0 runs with the server, rank 1 under `mlxd
    rank`, its Steps over TCP with CURVE under the server's key. Both stopped on the
    way out."""
    base = random.Random().randrange(33000, 60000, 10)
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "here", "ips": ["127.0.0.1"]}, {"ssh": "there", "ips": ["127.0.0.1"]}]}))
    key = folder / "server.key"
    subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(key)], check=True,
                   cwd=ROOT, capture_output=True)
    ports = ["--ring-port", str(base), "--rank-port", str(base + 5)]
    rank = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "rank", "--hostfile", str(hostfile),
         "--rank", "1", "--model", model, "--curve-secret-key", str(key),
         "--kv-capacity", "4096", *split, *ports], cwd=folder, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    server = None
    try:
        server = Server(model, "--hostfile", str(hostfile), "--curve-secret-key", str(key),
                        "--kv-capacity", "4096", "--speculative", "off", "--worker-timeout",
                        "5", "--log-level", "warning", *split, *ports)
        yield server, rank, f"tcp://127.0.0.1:{base + 5 + 1}"
    finally:
        if server is not None:
            server.stop()
        rank.terminate()
        try:
            rank.wait(10)
        except subprocess.TimeoutExpired:
            rank.kill()
        for pid in children_of(rank.pid):
            os.kill(pid, signal.SIGKILL)
