"""KV capacity against the memory meant for KV: the share of it the pool holds.

For each memory limit and KV format, starts the server on the model, reads the
worker's READY limits through the SDK's stats (kv_capacity, bytes_per_token,
weights_bytes) and reports kv_capacity / ((limit - weights - the activation
reserve) / bytes per token): 1.0 would be every byte left after the weights and the
reserve holding KV, once. Deterministic (a split, not a timing): one run each.

With `--chats N`, each server then takes N concurrent requests of `--chat-tokens`
prompt tokens (random ids: no prefix is shared) and `--max-tokens` output each, and
the report adds whether they all ran at once (every first token came before the first
request ended; `started_before_first_end` counts those that had), the retractions,
and the wall time: whether N such chats fit the pool together.

    python -m bench.capacity                      # the default model (SmolLM2-135M)
    python -m bench.capacity --limits 1.6,default --kv-bits 0,8
    python -m bench.capacity --limits 1.6 --kv-bits 0 --chats 10 --chat-tokens 900
    python -m bench.capacity --model PATH --json out.json
"""

import argparse
import asyncio
import json
import random

from bench.common import MlxdServer, bench_model, machine_summary, now, timed_stream


def limit_bytes(limit: str) -> int:
    """`default`: the worker's own limit (--mem-fraction of machine memory); else GiB."""
    from mlxd.runtime.flags import ServerFlags
    from mlxd.worker_proc.memory import memory_limit_bytes

    if limit == "default":
        return memory_limit_bytes(ServerFlags().mem_fraction, 0)
    return memory_limit_bytes(0, float(limit))


async def run_chats(address: str, vocab: int, n: int, prompt_tokens: int,
                    max_tokens: int) -> dict:
    """N concurrent streamed requests of ids below `vocab` (its upper half: no special
    tokens). They all ran at once when the last first token came before the first
    finish; a retracted one would have been set back meanwhile (`retractions`)."""
    from mlxd.client import AsyncClient

    rng = random.Random(0)
    prompts = [[rng.randrange(vocab // 2, vocab) for _ in range(prompt_tokens)]
               for _ in range(n)]
    async with AsyncClient(address, timeout=3600) as client:
        started = now()
        runs = await asyncio.gather(*(timed_stream(client, ids, max_tokens) for ids in prompts))
        wall = now() - started
        stats = await client.stats()
    assert all(tokens == max_tokens for _, _, tokens, _ in runs), runs
    last_start, first_end = max(r[0] for r in runs), min(r[1] for r in runs)
    running_at_once = sum(r[0] < first_end for r in runs)
    return {"chats": n, "chat_tokens": prompt_tokens, "max_tokens": max_tokens,
            "all_at_once": last_start < first_end, "started_before_first_end": running_at_once,
            "retractions": stats["retractions"], "wall_s": round(wall, 1)}


def measure(model: str, limit: str, bits: int, server_args: list[str],
            chats: tuple[int, int, int] | None = None) -> dict:
    from mlxd.client import Client
    from mlxd.worker_proc.memory import ACTIVATION_RESERVE_BYTES

    flags = [] if limit == "default" else ["--mem-limit-gb", limit]
    if bits:
        flags += ["--kv-bits", str(bits)]
    server = MlxdServer(model, *flags, *server_args)
    try:
        with Client(server.address) as client:
            stats = client.stats()
        ran = asyncio.run(run_chats(server.address, stats["worker"]["vocab_size"], *chats)) \
            if chats else {}
    finally:
        server.stop()
    worker = stats["worker"]
    room = limit_bytes(limit) - worker["weights_bytes"] - ACTIVATION_RESERVE_BYTES
    ideal = room // worker["bytes_per_token"]
    return {"limit": limit, "kv_bits": bits, "kv_capacity": worker["kv_capacity"],
            "bytes_per_token": worker["bytes_per_token"],
            "weights_mib": round(worker["weights_bytes"] / 2**20, 1),
            "ideal_tokens": ideal, "share": round(worker["kv_capacity"] / ideal, 3), **ran}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a model folder; default: the server's default model")
    ap.add_argument("--limits", default="1.6,default",
                    help="memory limits in GiB, or `default` (--mem-fraction)")
    ap.add_argument("--kv-bits", default="0,8", help="KV formats: 0 (float) or bits")
    ap.add_argument("--server-args", default="", help="extra launch.py flags")
    ap.add_argument("--chats", type=int, default=0,
                    help="then this many concurrent requests (0: none)")
    ap.add_argument("--chat-tokens", type=int, default=900, help="their prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=64, help="their output tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = bench_model(args.model)
    chats = (args.chats, args.chat_tokens, args.max_tokens) if args.chats else None
    rows = [measure(model, limit, int(bits), args.server_args.split(), chats)
            for limit in args.limits.split(",") for bits in args.kv_bits.split(",")]
    out = {"machine": machine_summary(), "model": model, "rows": rows}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
