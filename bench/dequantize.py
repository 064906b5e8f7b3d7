"""Single-stream prefill and decode speed with quantized vs dequantized weights.

    python -m bench.dequantize                   # the default model (SmolLM2-135M, Q4_1)
    python -m bench.dequantize --model PATH

Runs in one process with the worker's BLAS (re-executes itself with LD_PRELOAD
on Linux), alternating the two variants; prints medians and the ratio.
"""

import argparse
import os
import statistics
import sys

from bench.common import bench_model, random_prompts, rerun_with_worker_blas, tokenizer_vocab


def measure(model, tokenizer, prompt, gen_len):
    from mlx_lm import stream_generate

    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=gen_len):
        pass
    return last.prompt_tps, last.generation_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rerun_with_worker_blas(__spec__.name)
    from mlxd.worker_proc.loading import load_model

    path = bench_model(args.model)
    prompt = random_prompts(1, args.prompt_len, tokenizer_vocab(path))[0]
    variants = {name: load_model(path, dequantize=flag)
                for name, flag in (("quantized", False), ("dequantized", True))}
    results = {name: [] for name in variants}
    for name, (model, tok) in variants.items():   # warm up
        measure(model, tok, prompt[:16], 4)
    for _ in range(args.repeats):
        for name, (model, tok) in variants.items():
            results[name].append(measure(model, tok, prompt, args.gen_len))
    print(f"{path}: prompt {args.prompt_len}, output {args.gen_len}, "
          f"BLAS {os.environ.get('LD_PRELOAD') or 'bundled'}")
    med = {name: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
           for name, runs in results.items()}
    for name, (prefill, decode) in med.items():
        print(f"{name:12s} prefill {prefill:7.1f} tok/s   decode {decode:6.1f} tok/s")
    q, d = med["quantized"], med["dequantized"]
    print(f"ratio dequantized/quantized: prefill {d[0] / q[0]:.2f}x, decode {d[1] / q[1]:.2f}x")


if __name__ == "__main__":
    main()
