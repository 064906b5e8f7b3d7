"""Serving overhead: one stream of G output tokens through the server vs the same
model in-process with mlx_lm's stream_generate, overlap on and off, in one run.

    python -m bench.overhead                  # ~40M random-weight model, G=256
    python -m bench.overhead --model PATH --gen-len 256
    python -m bench.overhead --server-args "--decode-layout padded"

Where /proc exists it also reports the CPU time per output token of each process
(worker, scheduler, tokenizer, and this client), and runs stream_generate once more
while helper processes burn the CPU time per token the scheduler, tokenizer and
client used (one burner each, once per in-process token period): on a machine whose
cores the worker's BLAS threads already fill, that is the share of the decode rate
the other processes' work costs by itself, whatever the server does.

The reference runs in one child that loads the model once, as the server does, and
its runs alternate with the servers' (reference, overlap on, overlap off, per
repeat): each repeat's ratio compares runs seconds apart, and the spread of those
ratios is printed beside the ratio of the medians.

Where /proc exists it also reports, for the reference child and the worker, the CPU
time of their busiest thread (MLX's stream thread, which runs every kernel) per
output token, and its share of the wall time, both over the whole generation (its
prompt's prefill included): the kernel work per token, and how much of the time
that thread had work. Two systems doing the same work per token differ only in the
second figure.

    python -m bench.overhead --model smollm2 --gen-len 128   # the server's default model
"""

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import ROOT, MlxdServer, bench_model, blas_env, machine_summary, now, random_prompts, tokenizer_vocab


BURNER = """
import os, sys, time
busy, period, parent = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3])
while os.getppid() == parent:   # ends with the process that started it, however that ends
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(max(0.0, period - busy))
"""


def serve_in_process(model_path: str, prompt_len: int, gen_len: int) -> None:
    """The in-process reference (a child with the worker's BLAS, the model loaded once,
    like the server's): for each line `seed load_ms,... period_ms` on stdin, one
    generation of mlx_lm.stream_generate with one burner process per load entry (ms of
    CPU every period_ms), its decode tok/s on stdout."""
    from mlx_lm import stream_generate

    from mlxd.worker_proc.loading import load_model, resolve_dequantize

    model, tokenizer = load_model(model_path, resolve_dequantize("auto"))
    vocab = tokenizer_vocab(model_path)
    for _ in stream_generate(model, tokenizer, [11, 12, 13, 14], max_tokens=4):
        pass
    print("ready", flush=True)
    for line in sys.stdin:
        seed, load, period = line.split()
        prompt = random_prompts(1, prompt_len, vocab, seed=int(seed))[0]
        burners = [subprocess.Popen([sys.executable, "-c", BURNER, ms, period, str(os.getpid())])
                   for ms in load.split(",") if ms != "-"]
        try:
            last = None
            for last in stream_generate(model, tokenizer, prompt, max_tokens=gen_len):
                pass
        finally:
            for b in burners:
                b.kill()
                b.wait()
        print(last.generation_tps, flush=True)


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process `pid`; empty without /proc."""
    ticks = clock_ticks()
    out = {}
    for path in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[path.split("/")[4]] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def busiest_thread(before: dict, after: dict, tokens: int, wall: float) -> dict | None:
    """The thread that used the most CPU between two snapshots `wall` seconds apart:
    its CPU ms per token and its share of the wall time (None without /proc).
    `busy_error` is that share's resolution: /proc counts whole clock ticks, so each
    of the two snapshots may be off by one tick, which on a short run is a large part
    of `wall`."""
    if not after:
        return None
    cpu = max(after[t] - before.get(t, 0.0) for t in after)
    return {"ms_per_token": cpu * 1e3 / tokens, "busy": cpu / wall,
            "busy_error": 2.0 / clock_ticks() / wall}


def worker_pid(server: MlxdServer) -> int | None:
    try:
        with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
            children = f.read().split()
        for pid in children:
            with open(f"/proc/{pid}/cmdline") as f:
                if "mlxd.worker_proc" in f.read().split("\0"):
                    return int(pid)
    except OSError:
        pass
    return None


class InProcess:
    """The reference child, asked for one generation at a time (between server runs)."""

    def __init__(self, args):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--model", args.model, "--prompt-len",
             str(args.prompt_len), "--gen-len", str(args.gen_len), "--in-process-only"],
            env=blas_env(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        while self.proc.stdout.readline().strip() != "ready":
            if self.proc.poll() is not None:
                raise RuntimeError("the in-process reference did not start")

    def run(self, seed: int, load_ms: list[float] = (), period_ms: float = 0.0,
            tokens: int = 0) -> float:
        """Decode tok/s of one generation; with `tokens` (its length), its busiest
        thread is left in `busiest` (`busiest_thread`)."""
        load = ",".join(f"{ms:.3f}" for ms in load_ms) or "-"
        before, start = thread_cpu_seconds(self.proc.pid), now()
        self.proc.stdin.write(f"{seed} {load} {period_ms:.3f}\n")
        self.proc.stdin.flush()
        rate = float(self.proc.stdout.readline())
        if tokens:
            self.busiest = busiest_thread(before, thread_cpu_seconds(self.proc.pid), tokens,
                                          now() - start)
        return rate

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


async def _drive(server: MlxdServer, prompt: list[int],
                 gen_len: int) -> tuple[float, dict, dict, dict | None]:
    """Decode tok/s of one stream, the server's step timing (p50s) over its steps, the
    CPU ms per output token of each process (empty without /proc), and the worker's
    busiest thread (`busiest_thread`)."""
    from mlxd.client import AsyncClient

    async with AsyncClient(server.address, timeout=600) as c:
        await c.generate(input_ids=prompt[:8], max_tokens=4, ignore_eos=True)
        first = end = None
        tokens = 0
        worker = worker_pid(server)
        threads_before, start = thread_cpu_seconds(worker) if worker else {}, now()
        cpu_before, client_before = server.cpu_seconds(), time.process_time()
        async for chunk in c.stream(input_ids=prompt, max_tokens=gen_len, ignore_eos=True):
            if chunk.token_ids and first is None:
                first = now()
            tokens += len(chunk.token_ids)
            end = now()
        cpu_after, client_after = server.cpu_seconds(), time.process_time()
        threads_after = thread_cpu_seconds(worker) if worker else {}
        timing = (await c.stats())["timing"]
    p50 = {k: v["p50"] for k, v in timing.items() if isinstance(v, dict)}
    cpu = {}
    if cpu_before and cpu_after:
        cpu = {name.removesuffix("_proc"): (cpu_after[name] - cpu_before.get(name, 0.0)) * 1e3 / tokens
               for name in cpu_after}
        cpu["client"] = (client_after - client_before) * 1e3 / tokens
    busiest = busiest_thread(threads_before, threads_after, tokens, end - start)
    return (tokens - 1) / (end - first), p50, cpu, busiest   # decode rate after the first token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-process-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--server-args", default="", help="extra launch.py flags for both servers")
    args = ap.parse_args()
    args.model = bench_model(args.model)
    if args.in_process_only:
        serve_in_process(args.model, args.prompt_len, args.gen_len)
        return
    vocab = tokenizer_vocab(args.model)
    # the serving overhead of one token a step: speculation is bench.spec's subject
    extra = ["--speculative", "off", *args.server_args.split()]
    reference = InProcess(args)
    servers = {"overlap_on": MlxdServer(args.model, *extra),
               "overlap_off": MlxdServer(args.model, "--disable-overlap", *extra)}
    runs = {"in_process": [], "overlap_on": [], "overlap_off": []}
    step_timing = {"overlap_on": [], "overlap_off": []}
    cpu_runs = {"overlap_on": [], "overlap_off": []}
    busiest = {"in_process": [], "overlap_on": [], "overlap_off": []}
    try:
        # each repeat: the reference, then each server, on the same fresh prompt (no
        # prefix-cache hits); a repeat's ratio compares runs minutes apart at most
        for seed in range(args.repeats):
            prompt = random_prompts(1, args.prompt_len, vocab, seed=100 + seed)[0]
            runs["in_process"].append(reference.run(100 + seed, tokens=args.gen_len))
            busiest["in_process"].append(reference.busiest)
            for name, server in servers.items():
                rate, timing, cpu, top = asyncio.run(_drive(server, prompt, args.gen_len))
                runs[name].append(rate)
                step_timing[name].append(timing)
                cpu_runs[name].append(cpu)
                busiest[name].append(top)
        med = {k: statistics.median(v) for k, v in runs.items()}
        cpu_ms = {name: {p: statistics.median(c[p] for c in cpus) for p in cpus[0]}
                  for name, cpus in cpu_runs.items() if cpus[0]}
        others = [ms for p, ms in cpu_ms.get("overlap_on", {}).items() if p != "worker"]
        if others:   # the same prompts again, in-process, with the other processes' CPU work
            period_ms = 1e3 / med["in_process"]
            runs["in_process_loaded"] = [reference.run(100 + seed, others, period_ms)
                                         for seed in range(args.repeats)]
            med["in_process_loaded"] = statistics.median(runs["in_process_loaded"])
    finally:
        reference.stop()
        for server in servers.values():
            server.stop()
    paired = {name: sorted(a / b for a, b in zip(runs[name], runs["in_process"]))
              for name in servers}
    report = {"machine": machine_summary(), "model": args.model, "gen_len": args.gen_len,
              "decode_tok_s": med, "runs": runs, "step_timing_p50_ms": step_timing,
              "cpu_ms_per_token": cpu_ms,
              "busiest_thread_ms_per_token": busiest,
              "ratio_overlap_on": med["overlap_on"] / med["in_process"],
              "ratio_overlap_off": med["overlap_off"] / med["in_process"],
              # per repeat: the server's run over the reference's run just before it
              "paired_ratios": paired}
    print(f"one stream, {args.gen_len} output tokens; {report['machine']}")
    for name, value in med.items():
        print(f"{name:17s} {value:8.1f} decode tok/s")
    print(f"ratio to in-process: overlap on {report['ratio_overlap_on']:.3f}, "
          f"off {report['ratio_overlap_off']:.3f}")
    for name, ratios in paired.items():
        print(f"{name} / in-process, per repeat: median {statistics.median(ratios):.3f}, "
              f"range {ratios[0]:.3f}-{ratios[-1]:.3f}")
    print("server step timing, p50 ms over the last run's steps (client.stats()):")
    for name, timings in step_timing.items():
        print(f"  {name:12s} " + "  ".join(f"{k} {v:.2f}" for k, v in timings[-1].items()))
    if cpu_ms:
        print("CPU ms per output token (median over runs):")
        for name, per_process in cpu_ms.items():
            print(f"  {name:12s} " + "  ".join(f"{p} {ms:.2f}" for p, ms in per_process.items()))
    if all(v is not None for v in busiest["in_process"]):
        print("busiest thread (MLX's stream thread: the kernels), CPU ms per output token "
              "and its share of the wall time, prefill included (median over runs):")
        for name, values in busiest.items():
            ms = statistics.median(v["ms_per_token"] for v in values)
            busy = statistics.median(v["busy"] for v in values)
            print(f"  {name:12s} {ms:6.1f} ms, busy {busy:.2f}")
    if "in_process_loaded" in med:
        report["ratio_loaded_in_process"] = med["in_process_loaded"] / med["in_process"]
        print(f"in-process with the scheduler's, tokenizer's and client's CPU per token "
              f"burnt alongside: {report['ratio_loaded_in_process']:.3f} of in-process alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
