"""Ragged decode batches on the worker's own ModelRunner, in-process (no sockets).

Two figures of issue "decode without padding", each a ratio of two step times
measured alternately in one run (machine noise hits both alike):

  ragged  steady decode step of 63 rows x 256 tokens + 1 row x 4096, over the step of
          64 rows x 256 (padded caches: every row as wide as the longest)
  join    a step in which 1 row of 1280 tokens joins a 60-row batch of 1280-token rows
          (its prompt's KV read from the pool: one new token), over a step with no join;
          every step's time includes evaluating what it left lazy in the decode caches
          (the padded layout's join copy would otherwise land in the next step)

    python -m bench.ragged                      # the ~40M bench model (8k context)
    python -m bench.ragged --repeats 10 --json out.json

Each figure is measured for every decode layout asked (`--layouts`, default the
paged layout and the padded one it replaced), one after the other in one run.
The runner is driven as the scheduler would drive it (slot ids booked here, one Step
per call); overlap is off, so a step's time is its compute. Runs in a child process
with the worker's BLAS (bench/common.py blas_env).

    python -m bench.ragged --layouts paged,padded
    python -m bench.ragged --layouts paged,paged:kv8 --cases ragged   # --kv-bits 8 vs float
    python -m bench.ragged --layouts paged,paged:kv8+64 --cases ragged   # with --kv-float-tail 64
"""

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time

from bench.common import ROOT, blas_env, machine_summary


def bench_model_8k() -> str:
    """The bench model with an 8192-token context (bench/serving's)."""
    from bench.serving.__main__ import default_model

    return default_model()


class Driver:
    """Books slots and sends Steps to one ModelRunner, like the scheduler."""

    def __init__(self, model, capacity: int, layout: str):
        """`layout`: a decode layout, `:kvN` after it storing KV in N bits, `+T` after
        that with a float tail of T positions."""
        from mlxd.worker_proc.kv_pool import KVPool
        from mlxd.worker_proc.model_runner import probe_geometry, runner_for

        import mlx.core as mx

        from mlxd.runtime.kv_layout import DECODE_PAGE, decode_cache_budget
        from mlxd.scheduler_proc.allocator import SlotAllocator
        from mlxd.worker_proc.memory import buffer_cache_bytes

        from dataclasses import replace

        layout, _, kv = layout.partition(":kv")
        kv, _, tail = kv.partition("+")
        bits = int(kv) if kv else 0
        geometry = replace(probe_geometry(model), k_bits=bits, v_bits=bits)
        page = DECODE_PAGE if layout != "padded" else 1
        self.runner = runner_for(model, KVPool(geometry, capacity, page=page),
                                 decode_layout=layout, float_tail=int(tail or 0))
        # MLX's buffer cache set as the worker sets it
        mx.set_cache_limit(buffer_cache_bytes(self.runner.decode_page,
                                              decode_cache_budget(capacity, 64),
                                              geometry.bytes_per_token))
        # slots booked as the scheduler books them: in the pool's pages
        self.allocator, self.page = SlotAllocator(capacity, page), page
        self.own: dict[int, dict[int, int]] = {}
        self.step_ids = itertools.count(1)
        self.slot_ids: dict[int, list[int]] = {}
        self.running: list[int] = []

    def new_slots(self, rid: int, n: int, start: int | None = None) -> list[int]:
        held = self.slot_ids.setdefault(rid, [])
        start = len(held) if start is None else start
        own = self.own.setdefault(rid, {})
        got = self.allocator.extend(start, n, own.get(start // self.page, 0))
        for p in range(start, start + n):
            own[p // self.page] = got[p - start] // self.page
        held.extend(got)
        return got

    def prefill(self, rid: int, ids: list[int], prefix_slots=(), needs_logits=True):
        from mlxd.protocol import PrefillInput, SamplingParams

        return PrefillInput(rid, ids, list(prefix_slots),
                            self.new_slots(rid, len(ids), len(prefix_slots)),
                            SamplingParams(), needs_logits)

    def step(self, prefills=(), releases=()) -> float:
        """Run one Step; returns its wall time in seconds."""
        from mlxd.protocol import DecodeRow, Step

        self.running = [r for r in self.running if r not in releases]
        decode = [self.new_slots(rid, 1)[0] for rid in self.running]
        import mlx.core as mx

        start = time.perf_counter()
        rows = [DecodeRow(rid, slot) for rid, slot in zip(self.running, decode)]
        self.runner.run(Step(next(self.step_ids), rows, list(prefills), list(releases)))
        # what the step left lazy (the padded layout's join copy) counts in its time
        mx.eval(self.runner.batch.arrays())
        elapsed = time.perf_counter() - start
        self.running += [p.rid for p in prefills if p.needs_logits]
        return elapsed


def fill(driver: Driver, lengths: list[int], vocab: int, rng: random.Random,
         group_tokens: int = 4096) -> None:
    """Prefill one row per length, a few rows per step (decoding the ones in)."""
    rid = len(driver.slot_ids)
    batch, tokens = [], 0
    for n in lengths:
        batch.append(driver.prefill(rid, [rng.randrange(10, vocab) for _ in range(n)]))
        rid, tokens = rid + 1, tokens + n
        if tokens >= group_tokens:
            driver.step(batch)
            batch, tokens = [], 0
    if batch:
        driver.step(batch)


def ragged(model, vocab: int, steps: int, rng: random.Random, layout: str) -> dict:
    short, long_ = 256, 4096
    even = Driver(model, 64 * (short + steps + 64), layout)
    mixed = Driver(model, 63 * (short + steps + 64) + long_ + steps + 64, layout)
    fill(even, [short] * 64, vocab, rng)
    fill(mixed, [short] * 63 + [long_], vocab, rng)
    for _ in range(3):   # warm up: buffers of these shapes exist
        even.step(), mixed.step()
    times = {"even": [], "mixed": []}
    for _ in range(steps):
        times["even"].append(even.step())
        times["mixed"].append(mixed.step())
    return _ratio(times, "mixed", "even")


def join(model, vocab: int, steps: int, rng: random.Random, layout: str) -> dict:
    length = 1280
    d = Driver(model, 61 * (length + 2 * steps + 64) + steps * (length + 64), layout)
    fill(d, [length] * 60, vocab, rng)
    # KV for the joining rows' prompts, in the pool (prefilled once, not decoded)
    source = d.prefill(10_000, [rng.randrange(10, vocab) for _ in range(length)],
                       needs_logits=False)
    d.step([source])
    prefix = d.slot_ids[10_000][:length - 1]
    for _ in range(3):
        d.step()
    times = {"step": [], "join": []}
    for i in range(steps):
        times["step"].append(d.step())
        rid = 20_000 + i
        times["join"].append(d.step([d.prefill(rid, [rng.randrange(10, vocab)], prefix)]))
        d.step(releases=[rid])   # back to 60 rows (the dead row is dropped at the next join)
    return _ratio(times, "join", "step")


def _ratio(times: dict, num: str, den: str) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    return {f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()} | {
        "ratio": round(med[num] / med[den], 3),
        "ratio_per_pair": [round(a / b, 3) for a, b in zip(times[num], times[den])]}


def measure(args) -> dict:
    import mlx.core as mx

    from mlxd.worker_proc.loading import load_model, resolve_dequantize
    from mlxd.worker_proc.main import loaded_blas

    model, _ = load_model(args.model, resolve_dequantize("auto"))
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    out = {"blas": loaded_blas(), "device": str(mx.default_device())}
    for layout in args.layouts.split(","):
        rng = random.Random(args.seed)   # the same prompts for each layout
        for case, run in (("ragged", ragged), ("join", join)):
            if case in args.cases:
                out.setdefault(case, {})[layout] = run(model, vocab, args.repeats, rng, layout)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bench model with an 8k context")
    ap.add_argument("--cases", default="ragged,join")
    ap.add_argument("--layouts", default="paged,padded",
                    help="decode layouts to measure; `paged:kv8`: in pages of 8-bit KV, "
                    "`paged:kv8+64`: with a float tail of 64 positions")
    ap.add_argument("--repeats", type=int, default=8, help="timed steps per figure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or bench_model_8k()
    if args.in_process:
        print(json.dumps(measure(args)))
        return
    cmd = [sys.executable, "-m", "bench.ragged", "--in-process", "--model", args.model,
           "--cases", args.cases, "--layouts", args.layouts, "--repeats", str(args.repeats),
           "--seed", str(args.seed)]
    out = subprocess.run(cmd, env=blas_env(), cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-4000:])
    result = json.loads(out.stdout.strip().splitlines()[-1]) | {"machine": machine_summary()}
    for case, goal in (("ragged", "<= 1.3"), ("join", "<= 1.2")):
        for layout, r in result.get(case, {}).items():
            times = ", ".join(f"{k} {v} ms" for k, v in r.items() if k.endswith("_ms"))
            print(f"{case} ({layout}): ratio {r['ratio']} (target {goal}); median {times}")
    for case in ("ragged", "join"):   # stored KV in 8 bits against float, in this run
        runs = result.get(case, {})
        for layout in [name for name in runs if ":kv" in name]:
            base = runs.get(layout.partition(":kv")[0])
            if base:
                ratios = {k: round(runs[layout][k] / base[k], 3)
                          for k in base if k.endswith("_ms")}
                print(f"{case}: {layout} over {layout.partition(':kv')[0]} step time {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
