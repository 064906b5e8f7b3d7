"""Paged decode attention over 8-bit pages, two ways, against float pages, in one run:
`qmm` multiplies the pairs' pages as stored (`mx.gather_qmm`, what the server does);
`gather` gathers the pairs' quantized pages, dequantizes just those, and multiplies
them in float (`mx.gather_mm`). Reports the median time of one layer's attention per
decode step, and each way's ratio to float pages.

    python -m bench.kv_attention                  # 32 rows x 1024 positions, 8 KV heads
    python -m bench.kv_attention --rows 64 --length 256 --heads 3 --dim 64 --repeats 30
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

from bench.common import machine_summary


def setup(rows: int, length: int, heads: int, q_heads: int, dim: int, bits: int):
    from mlxd.worker_proc.decode_pages import PageArena, step_pairs

    page = 64
    pages = rows * -(-length // page)
    floats = PageArena(1, heads, dim, dim, mx.float32, pages, page)
    packed = PageArena(1, heads, dim, dim, mx.float32, pages, page, k_bits=bits, v_bits=bits)
    tables = []
    for _ in range(rows):
        table = floats.allocate(-(-length // page))
        assert packed.allocate(len(table)) == table
        for p in table:
            k, v = mx.random.normal((heads, page, dim)), mx.random.normal((heads, page, dim))
            floats.write_run(0, p, k, v)
            packed.write_run(0, p, k, v)
        tables.append(table)
    mx.eval(floats.keys, floats.values, packed.keys, packed.values)
    pairs = step_pairs(tables, [length] * rows, floats)
    queries = mx.random.normal((rows, q_heads, 1, dim))
    return floats, packed, pairs, queries, page


def gather_then_dequantize(queries, arena, pairs, page: int):
    """The alternative: the pairs' pages gathered, dequantized, multiplied in float."""
    from mlxd.worker_proc.decode_pages import paged_attention

    fk, fv = arena.k_format, arena.v_format
    rhs = pairs.rhs
    keys = [a.reshape(-1, page, a.shape[-1])[rhs] for a in arena.keys[0]]
    values = [a.reshape(-1, page, a.shape[-1])[rhs] for a in arena.values[0]]
    k = fk.decode(keys)   # [pairs * heads, page, dim]: only the pages read
    v = fv.decode(values)
    gathered = type(pairs)(pairs.rows, pairs.lhs, mx.arange(rhs.shape[0], dtype=mx.uint32),
                           pairs.mask, pairs.window)
    return paged_attention(queries, _as_arena(k, page), _as_arena(v, page), gathered, page,
                           0.125)


def _as_arena(pages: mx.array, page: int) -> mx.array:
    """`[m, page, dim]` as an arena `[1, m * page, dim]` whose matrix i is page i."""
    return pages.reshape(1, -1, pages.shape[-1])


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from mlxd.worker_proc.decode_pages import paged_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    floats, packed, pairs, q, page = setup(args.rows, args.length, args.heads, args.q_heads,
                                           args.dim, args.bits)
    ways = {
        "float": lambda: paged_attention(q, floats.keys[0][0], floats.values[0][0], pairs,
                                         page, 0.125),
        "qmm": lambda: paged_attention(q, packed.keys[0], packed.values[0], pairs, page,
                                       0.125, None, packed.k_format, packed.v_format),
        "gather": lambda: gather_then_dequantize(q, packed, pairs, page),
    }
    want = mx.array(ways["qmm"]())
    assert mx.allclose(ways["gather"](), want, atol=1e-4).item()
    ms = {name: timed(fn, args.repeats) * 1e3 for name, fn in ways.items()}
    report = {"machine": machine_summary(), **vars(args), "ms": ms,
              "qmm_over_float": ms["qmm"] / ms["float"],
              "gather_over_float": ms["gather"] / ms["float"]}
    print(f"{args.rows} rows x {args.length} positions, {args.heads} KV heads x {args.dim}, "
          f"{args.bits}-bit; {report['machine']}")
    print("  ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
    print(f"qmm / float {report['qmm_over_float']:.2f}x   gather+dequantize / float "
          f"{report['gather_over_float']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
