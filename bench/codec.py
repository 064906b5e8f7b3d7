"""Microseconds to encode + decode the per-step messages, as a decode step of 64 rows
makes them: the Step to the worker, its StepResult, and the TokenBatch to the tokenizer.

    python -m bench.codec
    python -m bench.codec --rows 64 --repeats 7
"""

import argparse
import random
import timeit

from mlxd.protocol import (
    DecodeRow, Decoder, Step, StepResult, StepTiming, TokenBatch, TokenEntry, encode,
)


def messages(rows: int) -> dict:
    rng = random.Random(0)
    rids = list(range(1, rows + 1))
    timing = StepTiming(compute_ms=12.5, wait_ms=0.8, idle_ms=0.1, chained_wait_ms=0.3,
                        chained=True, active_memory=2**31, peak_memory=2**32)
    return {
        "Step": Step(7, [DecodeRow(rid, rng.randrange(1, 2**20)) for rid in rids]),
        "StepResult": StepResult(7, rids, [rng.randrange(50000) for _ in rids],
                                 [-rng.random() * 5 for _ in rids], timing=timing),
        "TokenBatch": TokenBatch([TokenEntry(rid, [rng.randrange(50000)], [-rng.random()])
                                  for rid in rids]),
    }


def round_trip_us(msg, number: int, repeats: int) -> float:
    decoder = Decoder(type(msg))
    assert decoder.decode(encode(msg)) == msg
    times = timeit.repeat(lambda: decoder.decode(encode(msg)), number=number, repeat=repeats)
    return min(times) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for name, msg in messages(args.rows).items():
        print(f"{name:10s} {round_trip_us(msg, args.number, args.repeats):7.1f} us "
              "encode + decode (best of repeats)")


if __name__ == "__main__":
    main()
