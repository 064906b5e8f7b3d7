"""Soak: minutes of mixed, misbehaving traffic against one server on a small KV pool.

    python -m bench.soak                          # 5 minutes, the ~40M bench model
    python -m bench.soak --duration 60 --model demo-size-folder

Client behaviours, drawn at random per request by --clients concurrent loops:
  stream     stream to the end
  generate   one reply at the end (no stream)
  abort      abort the stream after a few chunks
  vanish     a client of its own that closes mid-stream (no abort from the caller)
  slow       read the stream slowly (a sleep between chunks)
  deadline   a short client-side timeout on a long request
  timeout    a short server-side deadline (the request's `timeout`) on a long stream

Printed: requests by behaviour and outcome, lost chunks (a finished stream whose
tokens do not add up to its usage, or a request that never got a finish: must be 0),
leaked slots once the server is idle (must be 0), and each process's RSS at the start
and the end. The run is bounded by --duration; the server is stopped at the end.
"""

import argparse
import asyncio
import collections
import random
import time

from bench.common import MlxdServer, bench_model, machine_summary, random_prompts, tokenizer_vocab
from mlxd import AsyncClient, MlxdError

BEHAVIOURS = ("stream", "generate", "abort", "vanish", "slow", "deadline", "timeout")


def process_rss_mb(launcher_pid: int) -> dict[str, float]:
    """Resident memory of each server process (Linux /proc; empty elsewhere)."""
    out = {}
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
            children = f.read().split()
    except OSError:
        return out
    for pid in children:
        try:
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        name = argv[argv.index("-m") + 1].removeprefix("mlxd.") if "-m" in argv else pid
        kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        out[name] = kb / 1024
    return out


class Tally:
    def __init__(self):
        self.outcomes: collections.Counter = collections.Counter()
        self.lost = 0

    def add(self, behaviour: str, outcome: str) -> None:
        self.outcomes[(behaviour, outcome)] += 1


async def _consume(stream, behaviour: str, rng: random.Random, tally: Tally) -> str:
    tokens, chunks, final = 0, 0, None
    async for chunk in stream:
        chunks += 1
        tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            final = chunk
        elif behaviour == "abort" and chunks == 3:
            await stream.abort()
        elif behaviour == "slow":
            await asyncio.sleep(rng.uniform(0.01, 0.1))
    if final is None:
        tally.lost += 1
        return "no finish"
    if final.usage and final.usage["completion_tokens"] != tokens:
        tally.lost += 1
    return final.finish_reason


async def _one(client: AsyncClient, address: str, behaviour: str, prompt: list[int],
               rng: random.Random, tally: Tally) -> None:
    max_tokens = rng.choice([8, 32, 128, 512])
    params = dict(input_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    try:
        if behaviour == "generate":
            outcome = (await client.generate(**params)).finish_reason
        elif behaviour == "vanish":
            own = AsyncClient(address, timeout=120)
            stream = own.stream(**params)
            async for _ in stream:
                break
            await own.close()
            outcome = "vanished"
        elif behaviour == "deadline":
            short = AsyncClient(address, timeout=0.2)
            try:
                outcome = (await short.generate(**{**params, "max_tokens": 512})).finish_reason
            finally:
                await short.close()
        elif behaviour == "timeout":
            stream = client.stream(**{**params, "max_tokens": 512, "timeout": 0.5})
            outcome = await _consume(stream, behaviour, rng, tally)
        else:
            outcome = await _consume(client.stream(**params), behaviour, rng, tally)
    except MlxdError as exc:
        outcome = f"error:{exc.code}"
    tally.add(behaviour, outcome)


async def soak(address: str, prompts: list[list[int]], clients: int, duration: float,
               seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + duration

    async def loop(i: int):
        rng = random.Random(seed * 1000 + i)
        behaviour = BEHAVIOURS[i % len(BEHAVIOURS)]   # with 6+ clients, every one runs
        async with AsyncClient(address, timeout=120) as client:
            while time.monotonic() < deadline:
                await _one(client, address, behaviour, rng.choice(prompts), rng, tally)
                behaviour = rng.choice(BEHAVIOURS)

    await asyncio.gather(*(loop(i) for i in range(clients)))
    return tally


async def idle_stats(address: str, timeout: float = 120.0) -> dict:
    """The server's stats once nothing runs or waits (or after `timeout`)."""
    async with AsyncClient(address, timeout=60) as client:
        end = time.monotonic() + timeout
        while True:
            stats = await client.stats()
            if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > end:
                return stats
            await asyncio.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bench model)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    ap.add_argument("--clients", type=int, default=24, help="concurrent client loops")
    ap.add_argument("--kv-capacity", type=int, default=4096, help="small, to force retraction")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = bench_model(args.model)
    prompts = random_prompts(64, args.prompt_len, tokenizer_vocab(model), args.seed)
    server = MlxdServer(model, "--kv-capacity", str(args.kv_capacity))
    try:
        rss_start = process_rss_mb(server.proc.pid)
        started = time.monotonic()
        tally = asyncio.run(soak(server.address, prompts, args.clients, args.duration,
                                 args.seed))
        stats = asyncio.run(idle_stats(server.address))
        rss_end = process_rss_mb(server.proc.pid)
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    print(f"# soak: {elapsed:.0f} s, {args.clients} clients, kv_capacity {args.kv_capacity}, "
          f"{machine_summary()}")
    for (behaviour, outcome), n in sorted(tally.outcomes.items()):
        print(f"{behaviour:9s} {outcome:24s} {n:6d}")
    leaked = stats["used_slots"] + stats["running"] + stats["waiting"]
    print(f"requests {sum(tally.outcomes.values())}, lost chunks {tally.lost}, "
          f"leaked slots {stats['used_slots']}, retractions {stats['retractions']}")
    for name in sorted(rss_start):
        print(f"RSS {name:15s} {rss_start[name]:8.0f} MB -> {rss_end.get(name, 0):8.0f} MB")
    if tally.lost or leaked:
        raise SystemExit("soak: lost chunks or leaked slots")


if __name__ == "__main__":
    main()
