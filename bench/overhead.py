"""Serving overhead: one stream of G output tokens through the server vs the same
model in-process with mlx_lm's stream_generate, overlap on and off, in one run.

    python bench/overhead.py                  # ~40M random-weight model, G=256
    python bench/overhead.py --model PATH --gen-len 256
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys

from common import ROOT, MlxdServer, bench_model, blas_env, machine_summary, now, random_prompts, tokenizer_vocab


def run_in_process(model_path: str, prompt: list[int], gen_len: int) -> float:
    """Decode tok/s of mlx_lm.stream_generate (called in a child with the worker's BLAS)."""
    from mlx_lm import stream_generate

    from worker_proc.loading import load_model, resolve_dequantize

    model, tokenizer = load_model(model_path, resolve_dequantize("auto"))
    for _ in stream_generate(model, tokenizer, prompt[:8], max_tokens=4):
        pass
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=gen_len):
        pass
    return last.generation_tps


async def _drive(address: str, prompt: list[int], gen_len: int) -> tuple[float, dict]:
    """Decode tok/s of one stream, and the server's step timing (p50s) over its steps."""
    from client import AsyncClient

    async with AsyncClient(address, timeout=600) as c:
        await c.generate(input_ids=prompt[:8], max_tokens=4, ignore_eos=True)
        first = end = None
        tokens = 0
        async for chunk in c.stream(input_ids=prompt, max_tokens=gen_len, ignore_eos=True):
            if chunk.token_ids and first is None:
                first = now()
            tokens += len(chunk.token_ids)
            end = now()
        timing = (await c.stats())["timing"]
    p50 = {k: v["p50"] for k, v in timing.items() if isinstance(v, dict)}
    return (tokens - 1) / (end - first), p50   # decode rate, after the first token


def in_child(args, prompt_seed: int) -> float:
    cmd = [sys.executable, __file__, "--model", args.model, "--prompt-len", str(args.prompt_len),
           "--gen-len", str(args.gen_len), "--seed", str(prompt_seed), "--in-process-only"]
    out = subprocess.run(cmd, env=blas_env(), cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--in-process-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.model = bench_model(args.model)
    vocab = tokenizer_vocab(args.model)
    if args.in_process_only:
        print(run_in_process(args.model, random_prompts(1, args.prompt_len, vocab, args.seed)[0],
                             args.gen_len))
        return
    servers = {"overlap_on": MlxdServer(args.model),
               "overlap_off": MlxdServer(args.model, "--disable-overlap")}
    runs = {"in_process": [], "overlap_on": [], "overlap_off": []}
    step_timing = {"overlap_on": [], "overlap_off": []}
    try:
        for seed in range(args.repeats):   # fresh prompts: no prefix-cache hits
            prompt = random_prompts(1, args.prompt_len, vocab, seed=100 + seed)[0]
            runs["in_process"].append(in_child(args, 100 + seed))
            for name, server in servers.items():
                rate, timing = asyncio.run(_drive(server.address, prompt, args.gen_len))
                runs[name].append(rate)
                step_timing[name].append(timing)
    finally:
        for server in servers.values():
            server.stop()
    med = {k: statistics.median(v) for k, v in runs.items()}
    report = {"machine": machine_summary(), "model": args.model, "gen_len": args.gen_len,
              "decode_tok_s": med, "runs": runs, "step_timing_p50_ms": step_timing,
              "ratio_overlap_on": med["overlap_on"] / med["in_process"],
              "ratio_overlap_off": med["overlap_off"] / med["in_process"]}
    print(f"one stream, {args.gen_len} output tokens; {report['machine']}")
    for name, value in med.items():
        print(f"{name:12s} {value:8.1f} decode tok/s")
    print(f"ratio to in-process: overlap on {report['ratio_overlap_on']:.3f}, "
          f"off {report['ratio_overlap_off']:.3f}")
    print("server step timing, p50 ms over the last run's steps (client.stats()):")
    for name, timings in step_timing.items():
        print(f"  {name:12s} " + "  ".join(f"{k} {v:.2f}" for k, v in timings[-1].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
