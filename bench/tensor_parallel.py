"""A worker group on this machine: N concurrent requests against one process and a
2-rank group, `--tp 2` or (with `--split pp`) `--pp 2` (the same model, flags and
fresh random prompts each repeat, runs alternating), output tokens per second and the
ratio; each rank's resident memory and weights; and what the group's collectives
cost per decode step at one decode step's shapes, timed alone on a 2-rank ring (tp:
the model's all_sums, two per layer; pp: the hidden state sent from stage to stage
and gathered on both).

Both ranks share this machine's cores (and its memory bandwidth), so a second rank
brings no throughput here: the figure to expect is below 1, the cost of the split.
Across machines (or Thunderbolt with JACCL) the ranks add compute and memory.

    python -m bench.tensor_parallel                 # ~40M random-weight model
    python -m bench.tensor_parallel --model smollm2 --n 16 --repeats 3
    python -m bench.tensor_parallel --split pp      # the bench model's qwen2 twin
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import (
    BENCH_SPEC, ROOT, MlxdServer, add_workload_arguments, bench_model, machine_summary,
    tokenizer_vocab,
)
from bench.throughput import alternating_runs
from mlxd.model_store.tiny import build_tiny_model, default_cache_dir
from mlxd.runtime.worker_group import free_ports, ring_environ, write_ring_hostfile

COLLECTIVE_STEPS = 200


def rank_memory(server: MlxdServer) -> dict[str, float]:
    """Resident MiB of each worker process (rank), by its name."""
    out = {}
    for pid in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") \
            .read_text().split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "mlxd.worker_proc" not in argv:
            continue
        name = next(a.split("=", 1)[1] for a in argv if a.startswith("--name="))
        rss = next(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmRSS"))
        out[name] = rss / 1024
    return out


def worker_stats(address: str) -> dict:
    from mlxd.client import Client

    with Client(address, timeout=60) as c:
        return c.stats()["worker"]


def collective_cost(model: str, batch: int, split: str) -> float:
    """ms per decode step spent in the collectives of a 2-rank split of `model`, on a
    ring over 127.0.0.1: tp, two all_sums per layer of batch x hidden float32; pp, one
    send of batch x hidden from stage to stage and one all_gather of it."""
    hostfile = write_ring_hostfile(tempfile.mktemp(suffix=".json"), free_ports(2))
    cmd = [sys.executable, "-m", __spec__.name, "--collective-child", model,
           "--n", str(batch), "--split", split]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **ring_environ(r, hostfile)})
             for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    os.unlink(hostfile)
    return float(outs[0].strip().splitlines()[-1])


def collective_child(model: str, batch: int, split: str) -> None:
    import time

    import mlx.core as mx

    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config", config)
    group = mx.distributed.init(strict=True, backend="ring")
    x = mx.ones((batch, text["hidden_size"]), mx.float32)
    calls = 2 * text["num_hidden_layers"]

    def tensor_step(y):
        for _ in range(calls):   # each depends on the last, as the layers do
            y = mx.distributed.all_sum(y, group=group) * 0.5
        return y

    def pipeline_step(y):   # rank 1 (first layers) sends to rank 0; both gather
        if group.rank() == 1:
            y = mx.distributed.send(y, 0, group=group)
        else:
            y = mx.distributed.recv_like(y, 1, group=group)
        return mx.distributed.all_gather(y, group=group)[:batch]

    step = pipeline_step if split == "pp" else tensor_step
    for _ in range(10):
        mx.eval(step(x))
    start = time.perf_counter()
    for _ in range(COLLECTIVE_STEPS):
        mx.eval(step(x))
    print((time.perf_counter() - start) / COLLECTIVE_STEPS * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    add_workload_arguments(ap)
    ap.add_argument("--split", choices=("tp", "pp"), default="tp",
                    help="tensor (--tp 2) or pipeline (--pp 2) parallel")
    ap.add_argument("--collective-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.collective_child:
        collective_child(args.collective_child, args.n, args.split)
        return
    if args.split == "pp" and not args.model:   # llama has no pipeline(); qwen2 does
        model = str(build_tiny_model(default_cache_dir() / "bench-qwen2-h512-l8-v32000",
                                     dataclasses.replace(BENCH_SPEC, arch="qwen2")))
    else:
        model = bench_model(args.model)
    vocab = tokenizer_vocab(model)
    capacity = args.n * (args.prompt_len + args.gen_len) + 1024
    flags = ["--max-running-requests", str(args.n), "--kv-capacity", str(capacity),
             "--speculative", "off", *args.server_args.split()]
    flag = f"--{args.split}"
    servers = {n: MlxdServer(model, *flags, flag, str(n)) for n in (1, 2)}
    try:
        memory = {tp: rank_memory(server) for tp, server in servers.items()}
        weights = {tp: worker_stats(server.address)["weights_bytes"] / 2**20
                   for tp, server in servers.items()}
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    runs = alternating_runs(servers, args, vocab, seed_base=200)
    med = {tp: statistics.median(values) for tp, values in runs.items()}
    print(f"N={args.n} P={args.prompt_len} G={args.gen_len} on {machine_summary()}")
    for n in (1, 2):
        print(f"{flag} {n}: {med[n]:8.1f} output tok/s   runs {[round(r, 1) for r in runs[n]]}"
              f"   weights per rank {weights[n]:.1f} MiB   resident "
              + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(memory[n].items())))
    print(f"ratio {args.split}2 / {args.split}1: {med[2] / med[1]:.3f}")
    print(f"weights per rank, {args.split}2 / {args.split}1: {weights[2] / weights[1]:.3f}")
    for batch in (1, args.n):
        print(f"collectives per decode step at batch {batch}: "
              f"{collective_cost(model, batch, args.split):.2f} ms")


if __name__ == "__main__":
    main()
