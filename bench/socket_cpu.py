"""CPU time per received ZeroMQ message: zmq.asyncio vs LoopSocket (runtime/aio.py) vs a
plain blocking receive, alternating, in one run.

A sender process pushes small frames at a steady rate over ipc://, as the scheduler
sends a token batch per step; the receiver's CPU time (all its threads, ZeroMQ's I/O
thread included) is divided by the messages received.

    python -m bench.socket_cpu
    python -m bench.socket_cpu --messages 1000 --period-ms 5 --repeats 5
"""

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time

import zmq
import zmq.asyncio

from bench.common import ROOT, machine_summary

SENDER = """
import sys, time, zmq
addr, n, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1e3
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.connect(addr)
for _ in range(n + 1):
    sock.send(b"x" * 100)
    time.sleep(period)
sock.close(linger=-1)
ctx.term()
"""


def _sender(addr: str, n: int, period_ms: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SENDER, addr, str(n), str(period_ms)])


async def _async_receive(addr: str, n: int, period_ms: float, loop_socket: bool) -> float:
    from mlxd.runtime.aio import LoopSocket

    ctx = zmq.asyncio.Context()
    raw = zmq.Socket(ctx, zmq.PULL) if loop_socket else ctx.socket(zmq.PULL)
    raw.bind(addr)
    sock = LoopSocket(raw) if loop_socket else raw
    sender = _sender(addr, n, period_ms)
    try:
        await sock.recv()   # the first message: both sides are up
        start = time.process_time()
        for _ in range(n):
            await sock.recv()
        return (time.process_time() - start) / n
    finally:
        sender.wait()
        sock.close(0)
        ctx.term()


def _blocking_receive(addr: str, n: int, period_ms: float) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    sender = _sender(addr, n, period_ms)
    try:
        sock.recv()
        start = time.process_time()
        for _ in range(n):
            sock.recv()
        return (time.process_time() - start) / n
    finally:
        sender.wait()
        sock.close(0)
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--period-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    try:
        import uvloop
        run = uvloop.run   # as the tokenizer runs
    except ImportError:
        run = asyncio.run
    ways = {
        "zmq.asyncio": lambda a: run(_async_receive(a, args.messages, args.period_ms, False)),
        "LoopSocket": lambda a: run(_async_receive(a, args.messages, args.period_ms, True)),
        "blocking recv": lambda a: _blocking_receive(a, args.messages, args.period_ms),
    }
    results = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        for r in range(args.repeats):
            for i, (name, way) in enumerate(ways.items()):
                results[name].append(way(f"ipc://{tmp}/s{r}-{i}") * 1e6)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"{args.messages} messages every {args.period_ms} ms; {machine_summary()}")
    for name, us in med.items():
        print(f"{name:14s} {us:7.1f} us CPU per received message   "
              f"ratio to zmq.asyncio {us / med['zmq.asyncio']:.2f}")


if __name__ == "__main__":
    main()
