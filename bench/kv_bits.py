"""--kv-bits against float KV on one model, in one run: the KV pool's capacity under
one memory limit, and greedy agreement: for each of N chat prompts, the first output
token (of M, ignore_eos) where the quantized server's greedy output leaves the float
server's.

    python -m bench.kv_bits                       # the default model, 32 prompts x 128
    python -m bench.kv_bits --bits 8 8/4 --n 32 --tokens 128 --json out.json
    python -m bench.kv_bits --bits 8@64 8@128      # K[/V][@GROUP]: --kv-group-size
    python -m bench.kv_bits --bits 8 8+0 8+16      # [+TAIL]: --kv-float-tail
"""

import argparse
import asyncio
import json
import statistics

from bench.common import MlxdServer, bench_model, machine_summary

TOPICS = ["the sea", "a lighthouse", "bread", "winter", "a robot", "the moon", "trains",
          "a garden", "chess", "rain", "a library", "volcanoes", "bees", "a violin",
          "deserts", "a bridge", "coffee", "owls", "the internet", "glaciers", "a market",
          "clocks", "whales", "a castle", "music", "paper", "storms", "a forest",
          "mathematics", "cats", "a harbor", "the sun"]


async def _outputs(address: str, prompts: list[str], tokens: int) -> tuple[list, dict]:
    from mlxd.client import AsyncClient

    async with AsyncClient(address, timeout=1800) as c:
        results = await asyncio.gather(*(
            c.chat([{"role": "user", "content": p}], max_tokens=tokens, ignore_eos=True)
            for p in prompts))
        return [r.token_ids for r in results], (await c.stats())["worker"]


def run(model: str, flags: list[str], prompts: list[str], args) -> tuple[list, dict]:
    server = MlxdServer(model, "--mem-limit-gb", str(args.mem_limit_gb),
                        "--max-running-requests", str(max(64, len(prompts))), *flags)
    try:
        return asyncio.run(_outputs(server.address, prompts, args.tokens))
    finally:
        server.stop()


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bits", nargs="+", default=["8", "8/4"],
                    help="K[/V][@GROUP][+TAIL] bits (and group size, float tail) to compare")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mem-limit-gb", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = bench_model(args.model)
    prompts = [f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]}." for i in range(args.n)]
    base, base_worker = run(model, [], prompts, args)
    report = {"machine": machine_summary(), "model": model, "n": args.n, "tokens": args.tokens,
              "float": {"kv_capacity": base_worker["kv_capacity"],
                        "kv_dtype": base_worker["kv_dtype"]}}
    print(f"{args.n} prompts x {args.tokens} tokens; {report['machine']}; float KV: "
          f"capacity {base_worker['kv_capacity']} ({base_worker['kv_dtype']})")
    for bits in args.bits:
        spec, _, tail = bits.partition("+")
        kv, _, group = spec.partition("@")
        k, _, v = kv.partition("/")
        # else the server's defaults
        grouped = ["--kv-group-size", group] if group else []
        tailed = ["--kv-float-tail", tail] if tail else []
        outputs, worker = run(model, ["--kv-bits-k", k, "--kv-bits-v", v or k, *grouped,
                                      *tailed], prompts, args)
        firsts = [first_divergence(a, b) for a, b in zip(outputs, base)]
        r = {"kv_capacity": worker["kv_capacity"], "kv_dtype": worker["kv_dtype"],
             "kv_float_tail": worker["kv_float_tail"],
             "capacity_ratio": worker["kv_capacity"] / base_worker["kv_capacity"],
             "first_divergence": firsts,
             "share_at_least_64": sum(f >= 64 for f in firsts) / len(firsts),
             "identical": sum(f >= args.tokens for f in firsts),
             "median_first_divergence": statistics.median(firsts)}
        report[bits] = r
        print(f"{bits} (float tail {r['kv_float_tail']}): capacity {r['kv_capacity']} "
              f"({r['capacity_ratio']:.2f}x float), "
              f"first divergence >= 64 on {r['share_at_least_64']:.0%} of prompts, identical "
              f"{r['identical']}/{args.n}, median first divergence "
              f"{r['median_first_divergence']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
