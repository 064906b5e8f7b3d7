"""KV capacity against the memory meant for KV: the share of it the pool holds.

For each memory limit and KV format, starts the server on the model, reads the
worker's READY limits through the SDK's stats (kv_capacity, bytes_per_token,
weights_bytes) and reports kv_capacity / ((limit - weights - the activation
reserve) / bytes per token): 1.0 would be every byte left after the weights and the
reserve holding KV, once. Deterministic (a split, not a timing): one run each.

    python -m bench.capacity                      # the default model (SmolLM2-135M)
    python -m bench.capacity --limits 1.6,default --kv-bits 0,8
    python -m bench.capacity --model PATH --json out.json
"""

import argparse
import json

from bench.common import MlxdServer, bench_model, machine_summary


def limit_bytes(limit: str) -> int:
    """`default`: the worker's own limit (--mem-fraction of machine memory); else GiB."""
    from mlxd.runtime.flags import ServerFlags
    from mlxd.worker_proc.memory import memory_limit_bytes

    if limit == "default":
        return memory_limit_bytes(ServerFlags().mem_fraction, 0)
    return memory_limit_bytes(0, float(limit))


def measure(model: str, limit: str, bits: int, server_args: list[str]) -> dict:
    from mlxd.client import Client
    from mlxd.worker_proc.memory import ACTIVATION_RESERVE_BYTES

    flags = [] if limit == "default" else ["--mem-limit-gb", limit]
    if bits:
        flags += ["--kv-bits", str(bits)]
    server = MlxdServer(model, *flags, *server_args)
    try:
        with Client(server.address) as client:
            stats = client.stats()
    finally:
        server.stop()
    worker = stats["worker"]
    room = limit_bytes(limit) - worker["weights_bytes"] - ACTIVATION_RESERVE_BYTES
    ideal = room // worker["bytes_per_token"]
    return {"limit": limit, "kv_bits": bits, "kv_capacity": worker["kv_capacity"],
            "bytes_per_token": worker["bytes_per_token"],
            "weights_mib": round(worker["weights_bytes"] / 2**20, 1),
            "ideal_tokens": ideal, "share": round(worker["kv_capacity"] / ideal, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a model folder; default: the server's default model")
    ap.add_argument("--limits", default="1.6,default",
                    help="memory limits in GiB, or `default` (--mem-fraction)")
    ap.add_argument("--kv-bits", default="0,8", help="KV formats: 0 (float) or bits")
    ap.add_argument("--server-args", default="", help="extra launch.py flags")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = bench_model(args.model)
    rows = [measure(model, limit, int(bits), args.server_args.split())
            for limit in args.limits.split(",") for bits in args.kv_bits.split(",")]
    out = {"machine": machine_summary(), "model": model, "rows": rows}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
