"""One attention layer's decode step under each KV layout, per batch shape.

    python -m bench.attention_layouts                 # the bench model's shapes
    python -m bench.attention_layouts --repeats 30 --json out.json
    python -m bench.attention_layouts --heads 32 --kv-heads 8 --head-dim 128

Cases: A 64 x 256 (the reference); B 63 x 256 + 1 x 4096 (ragged); C 64 x (1024
shared + 32 own); D 60 x 1280 and a row of 1280 joining. Every layout's output is
checked against a row-by-row reference before it is timed. Runs in one process
with the worker's BLAS (re-executes itself with LD_PRELOAD on Linux).
"""

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from bench.common import bench_model, blas_env, machine_summary

DTYPES = ("float32", "float16", "bfloat16")


def model_shape(path: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a model folder's config.json."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return (heads, cfg.get("num_key_value_heads", heads),
            cfg.get("head_dim") or cfg["hidden_size"] // heads)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model folder for the shapes (default: the bench model)")
    ap.add_argument("--heads", type=int, help="query heads (default: the model's)")
    ap.add_argument("--kv-heads", type=int, help="KV heads (default: the model's)")
    ap.add_argument("--head-dim", type=int, help="head dim (default: the model's)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--cases", default="ABCD", help="which cases, e.g. AB")
    ap.add_argument("--scale", type=int, default=1,
                    help="divide rows and lengths by this (quick runs)")
    ap.add_argument("--page", type=int, default=256, help="page size of the paged layout")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args(argv)


def reexec_with_blas() -> None:
    env = blas_env()
    if env.get("LD_PRELOAD") and os.environ.get("LD_PRELOAD") != env["LD_PRELOAD"]:
        argv = [sys.executable, "-m", "bench.attention_layouts", *sys.argv[1:]]
        os.execve(sys.executable, argv, env)


def main() -> None:
    args = parse_args()
    reexec_with_blas()
    import mlx.core as mx

    from mlxd.worker_proc.main import loaded_blas

    from .cases import Shape, standard_cases
    from .report import markdown, summary
    from .run import load_average, run_case

    heads, kv_heads, head_dim = model_shape(bench_model(args.model))
    shape = Shape(args.heads or heads, args.kv_heads or args.heads or kv_heads,
                  args.head_dim or head_dim, getattr(mx, args.dtype))
    load_before = load_average()
    results = []
    for case in standard_cases(args.scale):
        if case.name in args.cases:
            results += run_case(case, shape, args.repeats, args.warmup, args.page)
    info = {"machine": machine_summary(), "blas": loaded_blas(), "mlx": mx.__version__,
            "shape": f"{shape.heads} query heads, {shape.kv_heads} KV heads, head dim "
                     f"{shape.head_dim}, {args.dtype}",
            "repeats": args.repeats, "warmup": args.warmup, "page": args.page,
            "load_before": load_before, "load_after": load_average()}
    print(summary(info))
    print(markdown(results, [c for c in standard_cases(args.scale) if c.name in args.cases]))
    if args.json:
        rows = [{k: v for k, v in asdict(r).items()} for r in results]
        Path(args.json).write_text(json.dumps({**info, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
