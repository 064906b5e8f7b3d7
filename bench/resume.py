"""What a resume costs: N streams run, and once each has streamed S tokens a process
serving them is SIGKILLed; each stream pauses and goes on from its tokens. Printed,
per scenario: the pause of the resumed streams (the gap between chunks across the
kill), next to the same streams' ordinary gaps, a fresh request's TTFT with a prompt
as long as prompt + S (the prefill a resume runs) and the slowest TTFT of N such
requests sent at once to the idle server (the prefill work of resuming N). Scenarios:

  dp2-scheduler  --dp 2, engine1's scheduler killed: its streams go on on engine0
                 (detection + the resumed prefill; no restart is waited for)
  worker         one engine, its worker killed: every stream waits for the new worker
                 (its model load) and then prefills again

    python -m bench.resume --model smollm2          # the default model
    python -m bench.resume                          # ~40M random-weight model
"""

import argparse
import asyncio
import os
import signal
import statistics
import time
from pathlib import Path

from bench.common import MlxdServer, bench_model, machine_summary, random_prompts, \
    tokenizer_vocab
from mlxd.client import AsyncClient


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *children(int(child))]
    return found


def pid_of(server: MlxdServer, *words: str) -> int:
    for pid in children(server.proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if all(any(w.encode() in part for part in cmdline) for w in words):
            return pid
    raise LookupError(words)


async def _stream(client, ids, gen_len, streamed: asyncio.Event, after: int) -> list[float]:
    """The stream's chunk arrival times."""
    times, n = [], 0
    async for chunk in client.stream(input_ids=ids, max_tokens=gen_len, ignore_eos=True):
        times.append(time.perf_counter())
        n += len(chunk.token_ids)
        if n >= after:
            streamed.set()
    return times


async def _run(server, prompts, gen_len, after, victim) -> tuple[list, float]:
    async with AsyncClient(server.address, timeout=600) as c:
        events = [asyncio.Event() for _ in prompts]
        jobs = [asyncio.ensure_future(_stream(c, p, gen_len, e, after))
                for p, e in zip(prompts, events)]
        await asyncio.gather(*(e.wait() for e in events))
        killed_at = time.perf_counter()
        os.kill(victim(), signal.SIGKILL)
        return await asyncio.gather(*jobs), killed_at


async def _ttft(client, ids) -> float:
    start = time.perf_counter()
    async for _ in client.stream(input_ids=ids, max_tokens=1):
        return time.perf_counter() - start
    return float("nan")


async def _ttfts(server, prompts, at_once: bool) -> list[float]:
    """Each fresh prompt's TTFT: one at a time, or all sent at once."""
    async with AsyncClient(server.address, timeout=600) as c:
        if at_once:
            return list(await asyncio.gather(*(_ttft(c, p) for p in prompts)))
        return [await _ttft(c, p) for p in prompts]


def scenario(name, model, flags, victim_words, burst_n, args, vocab) -> None:
    server = MlxdServer(model, *flags)
    try:
        prompts = random_prompts(args.n, args.prompt_len, vocab, seed=11)
        long_len = args.prompt_len + args.after
        fresh = asyncio.run(_ttfts(server, random_prompts(3, long_len, vocab, seed=99), False))
        burst = asyncio.run(_ttfts(server, random_prompts(burst_n, long_len, vocab, seed=98),
                                   True))
        runs, killed_at = asyncio.run(_run(server, prompts, args.gen_len, args.after,
                                           lambda: pid_of(server, *victim_words)))
    finally:
        server.stop()
    pauses, gaps = [], []
    for times in runs:
        steps = [b - a for a, b in zip(times, times[1:])]
        after_kill = [b - a for a, b in zip(times, times[1:]) if a <= killed_at < b]
        if after_kill:
            pauses.append(after_kill[0])
        gaps += [g for g in steps if g not in after_kill]
    resumed = [p for p in pauses if p > 5 * statistics.median(gaps)]
    print(f"{name}: {len(resumed)} of {len(runs)} streams paused; pause median "
          f"{statistics.median(resumed) * 1e3:.0f} ms (min {min(resumed) * 1e3:.0f}, max "
          f"{max(resumed) * 1e3:.0f}); ordinary gap median "
          f"{statistics.median(gaps) * 1e3:.1f} ms; fresh TTFT for "
          f"{long_len} prompt tokens {statistics.median(fresh) * 1e3:.0f} ms, the slowest "
          f"of {burst_n} sent at once to the idle server {max(burst) * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help='a folder, "smollm2", or none (~40M)')
    ap.add_argument("--n", type=int, default=8, help="concurrent streams")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--after", type=int, default=64, help="tokens streamed before the kill")
    ap.add_argument("--scenario", choices=("dp2-scheduler", "worker", "both"), default="both")
    args = ap.parse_args()
    model = bench_model(args.model)
    vocab = tokenizer_vocab(model)
    print(f"N={args.n} P={args.prompt_len} G={args.gen_len} killed after {args.after} "
          f"tokens, on {machine_summary()}")
    base = ["--speculative", "off", "--max-running-requests", str(2 * args.n)]
    if args.scenario in ("dp2-scheduler", "both"):
        scenario("dp2-scheduler", model, [*base, "--dp", "2"],
                 ("mlxd.scheduler_proc", "--engine=engine1"), args.n, args, vocab)
    if args.scenario in ("worker", "both"):
        scenario("worker", model, base, ("mlxd.worker_proc",), args.n, args, vocab)


if __name__ == "__main__":
    main()
