"""Replicas on one machine: N concurrent requests against `--dp 1` and `--dp 2` (the
same model, flags and fresh random prompts each repeat, runs alternating), output
tokens per second and the ratio. Each replica is a worker of its own: on a machine
whose cores one worker already keeps busy, a second brings no throughput (it takes
half of the same cores); where memory bandwidth or cores are left over, it does.

    python -m bench.replicas                     # ~40M random-weight model
    python -m bench.replicas --model smollm2 --n 32 --repeats 3
"""

import argparse
import statistics

from bench.common import (
    MlxdServer, add_workload_arguments, bench_model, machine_summary, tokenizer_vocab,
)
from bench.throughput import alternating_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    add_workload_arguments(ap)
    args = ap.parse_args()
    model = bench_model(args.model)
    vocab = tokenizer_vocab(model)
    capacity = args.n * (args.prompt_len + args.gen_len) + 1024
    flags = ["--max-running-requests", str(args.n), "--kv-capacity", str(capacity),
             *args.server_args.split()]
    servers = {dp: MlxdServer(model, *flags, "--dp", str(dp)) for dp in (1, 2)}
    runs = alternating_runs(servers, args, vocab, seed_base=100)
    med = {dp: statistics.median(values) for dp, values in runs.items()}
    print(f"N={args.n} P={args.prompt_len} G={args.gen_len} on {machine_summary()}")
    for dp in (1, 2):
        print(f"--dp {dp}: {med[dp]:8.1f} output tok/s   runs {[round(r, 1) for r in runs[dp]]}")
    print(f"ratio dp2 / dp1: {med[2] / med[1]:.3f}")


if __name__ == "__main__":
    main()
