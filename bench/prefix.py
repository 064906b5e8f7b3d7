"""Shared-prefix workload: the radix cache on vs off, in one run.

64 requests share a 1024-token system prompt, each with its own 32-token
question, 32 output tokens each (ignore_eos), all sent at once through the async
SDK. Reports time to first token (p50, p90) and output throughput per setting.

    python -m bench.prefix                 # ~40M random-weight model
    python -m bench.prefix --model PATH --n 64 --shared 1024 --question 32 --gen-len 32
    python -m bench.prefix --hybrid qwen3_next   # a tiny recurrent-state test model:
                                                 # the cache is KV + state snapshots
    python -m bench.prefix --hybrid gemma3_text  # sliding windows: KV + window slots
    python -m bench.prefix --server-args "--decode-layout padded"   # the padded decode
    python -m bench.prefix --restart       # the disk tier (--kv-disk): TTFT of a 4k-token
                                           # prompt cold, from memory, and from disk after
                                           # a restart (the default model, SmolLM2-135M)
    python -m bench.prefix --half-cached   # TTFT of a 4k-token prompt cold and with its
                                           # first half cached (the default model)
"""

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile

from bench.common import (
    MlxdServer, bench_model, machine_summary, now, random_prompts, timed_stream, tokenizer_vocab,
)


async def _drive(address: str, prompts, gen_len: int) -> dict:
    from mlxd.client import AsyncClient

    async with AsyncClient(address, timeout=900) as c:
        await c.generate(input_ids=prompts[0][-8:], max_tokens=2, ignore_eos=True)   # warm up
        start = now()

        async def one(ids):
            first, _, tokens, _ = await timed_stream(c, ids, gen_len)
            return first - start, tokens

        results = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = now() - start
        stats = await c.stats()
    ttfts = sorted(r[0] for r in results)
    produced = sum(r[1] for r in results)
    assert produced == len(prompts) * gen_len, produced
    return {"ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "output_tok_s": produced / elapsed, "elapsed_s": elapsed,
            "free_slots": stats["free_slots"], "cached_slots": stats["cached_slots"],
            "snapshots": stats.get("snapshots", 0),
            # the worker's peak MLX memory over the run (pool, decode caches, transients)
            "peak_memory_gb": stats["worker"]["peak_memory"] / 1024**3,
            "cached_window_slots": stats.get("cached_window_slots", 0)}


def hybrid_model(arch: str) -> str:
    from mlxd.model_store.tiny import build_tiny_model, default_cache_dir, hybrid_spec

    return str(build_tiny_model(default_cache_dir() / f"bench-{arch}-tiny", hybrid_spec(arch)))


def run(model: str, prompts, gen_len: int, cache: bool, args) -> dict:
    # room for every row of the padded decode caches (256-token steps), both settings
    capacity = len(prompts) * -(-(len(prompts[0]) + gen_len + 1) // 256) * 256 + 2048
    flags = ["--max-running-requests", str(len(prompts)), "--kv-capacity", str(capacity)]
    if not cache:
        flags.append("--disable-radix-cache")
    server = MlxdServer(model, *flags, *args.server_args.split())
    try:
        return asyncio.run(_drive(server.address, prompts, gen_len))
    finally:
        server.stop()


async def _ttft(address: str, prompt: list[int], warm: list[int]) -> tuple[float, float, dict]:
    """(seconds to the first token of `prompt`, to its second (the first decode after
    the prefill: it waits for the step's pool writes, a join's included), its usage),
    after a warm-up request."""
    from mlxd.client import AsyncClient

    async with AsyncClient(address, timeout=900) as c:
        await c.generate(input_ids=warm, max_tokens=2, ignore_eos=True)
        start = now()
        first, end, _, usage = await timed_stream(c, prompt, 2)
    return first - start, end - start, usage


def restart_run(model: str, prompt: list[int], warm: list[int], args) -> dict:
    """TTFT of `prompt` on a fresh --kv-disk directory (cold), again (memory), and
    after a restart on the same directory (disk)."""
    folder = tempfile.mkdtemp(prefix="mlxd-bench-kv-")
    flags = ["--kv-disk", folder, "--kv-capacity", str(3 * len(prompt)),
             *args.server_args.split()]
    try:
        first = MlxdServer(model, *flags)
        try:
            cold, _, _ = asyncio.run(_ttft(first.address, prompt, warm))
            memory, _, hit = asyncio.run(_ttft(first.address, prompt, warm))
        finally:
            first.stop()
        second = MlxdServer(model, *flags)
        try:
            disk, _, read = asyncio.run(_ttft(second.address, prompt, warm))
        finally:
            second.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert read.get("disk_tokens", 0) > 0, read
    return {"cold_s": cold, "memory_s": memory, "disk_s": disk,
            "memory_cached": hit.get("cached_tokens", 0), "disk_cached": read["disk_tokens"]}


async def _half_cached(address: str, cold: list[int], prompt: list[int],
                       warm: list[int]) -> dict:
    """TTFT and time to the second token of `cold` (nothing cached) and of `prompt`
    after its first half ran as a request of its own (cached), on one server."""
    from mlxd.client import AsyncClient

    cold_s, cold_second_s, _ = await _ttft(address, cold, warm)
    async with AsyncClient(address, timeout=900) as c:
        await c.generate(input_ids=prompt[:len(prompt) // 2], max_tokens=2, ignore_eos=True)
    half_s, half_second_s, usage = await _ttft(address, prompt, warm)
    return {"cold_s": cold_s, "half_cached_s": half_s, "cached": usage.get("cached_tokens", 0),
            "cold_second_token_s": cold_second_s, "half_cached_second_token_s": half_second_s}


def half_cached_main(args) -> None:
    model = bench_model(args.model or "smollm2")
    vocab = tokenizer_vocab(model)
    server = MlxdServer(model, *args.server_args.split())
    try:
        runs = [asyncio.run(_half_cached(
            server.address, random_prompts(1, args.restart_len, vocab, seed=200 + k)[0],
            random_prompts(1, args.restart_len, vocab, seed=300 + k)[0],
            random_prompts(1, 8, vocab, seed=99)[0])) for k in range(args.repeats)]
    finally:
        server.stop()
    report = {"machine": machine_summary(), "model": model, "prompt": args.restart_len,
              **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def restart_main(args) -> None:
    model = bench_model(args.model or "smollm2")
    vocab = tokenizer_vocab(model)
    runs = []
    for k in range(args.repeats):   # a new prompt each time: the cold run is cold
        prompt = random_prompts(1, args.restart_len, vocab, seed=100 + k)[0]
        runs.append(restart_run(model, prompt, random_prompts(1, 8, vocab, seed=99)[0], args))
    report = {"machine": machine_summary(), "model": model, "prompt": args.restart_len,
              **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    report["cold_over_disk"] = report["cold_s"] / report["disk_s"]
    report["disk_over_memory"] = report["disk_s"] / report["memory_s"]
    print(f"{args.restart_len}-token prompt, TTFT (median of {args.repeats}); "
          f"{report['machine']}")
    print(f"cold {report['cold_s']:.3f} s   memory hit {report['memory_s']:.3f} s "
          f"({report['memory_cached']:.0f} cached)   disk hit after restart "
          f"{report['disk_s']:.3f} s ({report['disk_cached']:.0f} from disk)")
    print(f"cold / disk: {report['cold_over_disk']:.1f}x   disk / memory: "
          f"{report['disk_over_memory']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--shared", type=int, default=1024)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--server-args", default="", help="extra launch.py flags")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hybrid", default=None, metavar="ARCH",
                    help="a tiny test model of this architecture (model_store.tiny.HYBRID_EXTRA)")
    ap.add_argument("--restart", action="store_true",
                    help="the disk tier: TTFT cold, from memory, from disk after a restart")
    ap.add_argument("--restart-len", type=int, default=4000,
                    help="the prompt of --restart and --half-cached")
    ap.add_argument("--half-cached", action="store_true",
                    help="TTFT of a prompt cold and with its first half cached")
    args = ap.parse_args()
    if args.restart:
        return restart_main(args)
    if args.half_cached:
        return half_cached_main(args)
    model = hybrid_model(args.hybrid) if args.hybrid else bench_model(args.model)
    vocab = tokenizer_vocab(model)
    system = random_prompts(1, args.shared, vocab, seed=1)[0]
    prompts = [system + q for q in random_prompts(args.n, args.question, vocab, seed=2)]
    runs = {"cache_on": [], "cache_off": []}
    for _ in range(args.repeats):
        runs["cache_off"].append(run(model, prompts, args.gen_len, False, args))
        runs["cache_on"].append(run(model, prompts, args.gen_len, True, args))
    report = {"machine": machine_summary(), "model": model, "n": args.n, "shared": args.shared,
              "question": args.question, "gen_len": args.gen_len}
    for name, rs in runs.items():
        report[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    on, off = report["cache_on"], report["cache_off"]
    report["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    report["throughput_ratio"] = on["output_tok_s"] / off["output_tok_s"]
    print(f"{args.n} requests: {args.shared}-token shared prefix + {args.question}-token "
          f"question, {args.gen_len} output tokens; {report['machine']}")
    for name in ("cache_off", "cache_on"):
        r = report[name]
        held = (f"  window slots {r['cached_window_slots']:.0f}"
                if r["cached_window_slots"] else "")
        print(f"{name:10s} TTFT p50 {r['ttft_p50_s']:7.2f} s  p90 {r['ttft_p90_s']:7.2f} s  "
              f"output {r['output_tok_s']:7.1f} tok/s  cached slots {r['cached_slots']:.0f}"
              f"{held}  worker peak memory {r['peak_memory_gb']:.2f} GiB")
    print(f"cache on vs off: TTFT p50 {report['ttft_p50_speedup']:.1f}x lower, "
          f"throughput {report['throughput_ratio']:.1f}x higher")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
