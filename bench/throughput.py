"""Throughput: N concurrent requests of P prompt + G output tokens.

mlxd through the async SDK (overlap on, and with --disable-overlap) vs the same
workload in-process with mlx_lm's BatchGenerator, on the same model with the same
BLAS, alternating runs. Every repeat uses fresh random prompts, so mlxd's prefix
cache never helps.

    python -m bench.throughput                 # ~40M random-weight model
    python -m bench.throughput --model smollm2   # the default model, SmolLM2-135M
    python -m bench.throughput --model PATH --n 64 --prompt-len 128 --gen-len 64

Both systems load the weights the same way (the worker's load_model: quantized
models are dequantized on the CPU backend, as `--dequantize auto` does).
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys

from bench.common import (
    ROOT, MlxdServer, add_workload_arguments, bench_model, blas_env, machine_summary, now, random_prompts,
    tokenizer_vocab,
)


def run_batch_generator(model_path: str, prompts: list[list[int]], gen_len: int) -> float:
    """Output tok/s of mlx_lm's BatchGenerator (called in a child with the worker's BLAS)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlxd.worker_proc.loading import load_model, resolve_dequantize

    model, _ = load_model(model_path, resolve_dequantize("auto"))
    warm = BatchGenerator(model, max_tokens=4)
    warm.insert(prompts[:2])
    while warm.next_generated():
        pass
    warm.close()
    gen = BatchGenerator(model, max_tokens=gen_len, completion_batch_size=len(prompts))
    start = now()
    gen.insert(prompts)
    produced = 0
    while responses := gen.next_generated():
        produced += len(responses)
    elapsed = now() - start
    gen.close()
    mx.synchronize()
    assert produced == len(prompts) * gen_len, produced
    return produced / elapsed


async def _drive_mlxd(address: str, prompts, gen_len: int) -> float:
    from mlxd.client import AsyncClient

    async with AsyncClient(address, timeout=600) as c:
        await c.generate(input_ids=prompts[0][:8], max_tokens=4, ignore_eos=True)
        start = now()
        results = await asyncio.gather(*(
            c.generate(input_ids=p, max_tokens=gen_len, ignore_eos=True) for p in prompts))
        elapsed = now() - start
    produced = sum(len(r.token_ids) for r in results)
    assert produced == len(prompts) * gen_len, produced
    return produced / elapsed


def run_mlxd(address: str, prompts, gen_len: int) -> float:
    return asyncio.run(_drive_mlxd(address, prompts, gen_len))


def alternating_runs(servers: dict, args, vocab: int, seed_base: int) -> dict[object, list]:
    """Output tok/s of each server, `args.repeats` times in turn, each repeat on fresh
    random prompts (no prefix-cache hits); the servers are stopped at the end."""
    runs: dict[object, list[float]] = {key: [] for key in servers}
    try:
        for seed in range(args.repeats):
            prompts = random_prompts(args.n, args.prompt_len, vocab, seed=seed_base + seed)
            for key, server in servers.items():
                runs[key].append(run_mlxd(server.address, prompts, args.gen_len))
    finally:
        for server in servers.values():
            server.stop()
    return runs


def baseline_in_child(args, seed: int) -> float:
    cmd = [sys.executable, "-m", __spec__.name, "--model", args.model, "--n", str(args.n),
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
           "--seed", str(seed), "--baseline-only"]
    out = subprocess.run(cmd, env=blas_env(), cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_workload_arguments(ap)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = bench_model(args.model)
    vocab = tokenizer_vocab(args.model)
    if args.baseline_only:
        prompts = random_prompts(args.n, args.prompt_len, vocab, seed=args.seed)
        print(run_batch_generator(args.model, prompts, args.gen_len))
        return
    capacity = args.n * (args.prompt_len + args.gen_len) + 1024
    flags = ["--max-running-requests", str(args.n), "--kv-capacity", str(capacity),
             *args.server_args.split()]
    servers = {"mlxd": MlxdServer(args.model, *flags),
               "mlxd_no_overlap": MlxdServer(args.model, *flags, "--disable-overlap")}
    runs = {"batch_generator": [], "mlxd": [], "mlxd_no_overlap": []}
    try:
        for seed in range(args.repeats):   # fresh prompts each time: no prefix-cache hits
            prompts = random_prompts(args.n, args.prompt_len, vocab, seed=seed)
            runs["batch_generator"].append(baseline_in_child(args, seed))
            for name, server in servers.items():
                runs[name].append(run_mlxd(server.address, prompts, args.gen_len))
    finally:
        for server in servers.values():
            server.stop()
    med = {name: statistics.median(values) for name, values in runs.items()}
    report = {
        "machine": machine_summary(), "model": args.model, "n": args.n,
        "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "mlxd_tok_s": med["mlxd"], "mlxd_no_overlap_tok_s": med["mlxd_no_overlap"],
        "batch_generator_tok_s": med["batch_generator"],
        "runs_mlxd": runs["mlxd"], "runs_mlxd_no_overlap": runs["mlxd_no_overlap"],
        "runs_batch_generator": runs["batch_generator"],
        "ratio": med["mlxd"] / med["batch_generator"],
        "ratio_no_overlap": med["mlxd_no_overlap"] / med["batch_generator"],
    }
    print(f"N={args.n} P={args.prompt_len} G={args.gen_len} on {report['machine']}")
    print(f"mlx_lm BatchGenerator (in-process): {med['batch_generator']:8.1f} output tok/s")
    print(f"mlxd (server, SDK), overlap on:     {med['mlxd']:8.1f} output tok/s"
          f"   ratio {report['ratio']:.3f}")
    print(f"mlxd, --disable-overlap:            {med['mlxd_no_overlap']:8.1f} output tok/s"
          f"   ratio {report['ratio_no_overlap']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
