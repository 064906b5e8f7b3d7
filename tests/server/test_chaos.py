"""The chaos test: under steady streaming load, SIGKILL the worker, then SIGKILL a
client process mid-stream, then SIGSTOP the worker past --worker-timeout and SIGCONT
it. Every request of the surviving clients completes (those running at the death or
the hang resume from their tokens so far), no KV slot leaks, and requests complete
again afterwards."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mlxd.client import Client, MlxdError
from support import ROOT, Server, pid_alive, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find child processes")

THREADS = 4
WORKER_TIMEOUT = 2.0
AFTER = 8                 # requests that must complete once the chaos is over
TIME_LIMIT = 85.0         # the whole test, chaos and checks, in seconds at most
PROMPTS = ["Once upon a time", "The capital of France", "a b c d", "Hello there model"]


class LoadThread(threading.Thread):
    """Streams requests one after another until `stop` is set. `finishes` holds each
    request's last chunk; `failures` what raised instead of a finish."""

    def __init__(self, address: str, index: int, stop: threading.Event):
        super().__init__(name=f"load-{index}", daemon=True)
        self.address, self.index, self.stop = address, index, stop
        self.finishes: list = []
        self.failures: list[Exception] = []

    def run(self) -> None:
        with Client(self.address, timeout=30) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                prompt = PROMPTS[(self.index + n) % len(PROMPTS)]
                try:
                    chunks = list(client.stream(prompt, max_tokens=40 + 20 * self.index,
                                                ignore_eos=True))
                    self.finishes.append(chunks[-1])
                except MlxdError as exc:
                    self.failures.append(exc)


CLIENT_PROCESS = textwrap.dedent("""
    import sys
    from mlxd import Client
    c = Client(sys.argv[1], timeout=60)
    streams = [c.stream("Once upon a time", max_tokens=100000, ignore_eos=True)
               for _ in range(8)]
    for chunk in streams[0]:
        print("streaming", flush=True)
""")


class Budget:
    """What is left of the test's time: each wait gets its own limit, or less."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def __call__(self, limit: float) -> float:
        return max(0.1, min(limit, self.end - time.monotonic()))


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The process's first line of output, or "" if none came within `timeout`."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(timeout)
    return lines[0] if lines else ""


def stats(server: Server) -> dict:
    with Client(server.address, timeout=30) as c:
        return c.stats()


def running_at_least(server: Server, n: int) -> bool:
    return stats(server)["running"] >= n


def test_chaos(llama_model):
    within = Budget(TIME_LIMIT)
    server = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning",
                    "--worker-timeout", str(WORKER_TIMEOUT))
    stop = threading.Event()
    threads = [LoadThread(server.address, i, stop) for i in range(THREADS)]
    client = None
    worker = None
    try:
        for t in threads:
            t.start()
        # 1. the worker dies under load; a new one takes over
        assert wait_until(lambda: running_at_least(server, 2), within(15))
        os.kill(server.child("worker_proc"), signal.SIGKILL)
        assert wait_until(lambda: stats(server)["worker_restarts"] == 1
                          and stats(server)["worker_status"] == "ok", within(40)), (
            stats(server), server.stderr_lines[-30:])
        # 2. a client process is killed mid-stream
        client = subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, server.address],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert first_line(client, within(20)).strip() == "streaming"
        client.kill()
        client.wait()
        # 3. the worker hangs past --worker-timeout, then comes back
        assert wait_until(lambda: running_at_least(server, 2), within(15))
        worker = server.child("worker_proc")
        os.kill(worker, signal.SIGSTOP)
        try:
            assert wait_until(lambda: stats(server)["worker_status"] == "unresponsive",
                              within(15))
        finally:
            os.kill(worker, signal.SIGCONT)
        assert wait_until(lambda: stats(server)["worker_status"] == "ok", within(15))
        stop.set()
        for t in threads:
            t.join(within(30))
            assert not t.is_alive(), f"{t.name} hangs"

        # every request of the surviving clients completed, some of them resumed; one
        # running at both the death and the hang ends with an error saying so
        finishes = [f for t in threads for f in t.finishes]
        assert not [f for t in threads for f in t.failures]
        assert {f.finish_reason for f in finishes} <= {"length", "error"}
        errors = [f.error for f in finishes if f.finish_reason == "error"]
        assert all("unresponsive" in e and "2 failures in a row" in e for e in errors), errors
        assert sum(f.usage["resumes"] for f in finishes) >= 2   # the death, the hang
        # throughput returns, and no slot leaked
        with Client(server.address, timeout=60) as c:
            results = [c.generate(PROMPTS[i % len(PROMPTS)], max_tokens=16, ignore_eos=True)
                       for i in range(AFTER)]
            assert [r.finish_reason for r in results] == ["length"] * AFTER
            assert wait_until(lambda: c.stats()["running"] + c.stats()["waiting"] == 0,
                              within(15))
            final = c.stats()
        assert final["used_slots"] == 0, final
        assert final["free_slots"] + final["cached_slots"] == final["capacity"], final
        assert server.proc.poll() is None
    finally:
        stop.set()
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        if worker is not None and pid_alive(worker):
            os.kill(worker, signal.SIGCONT)
        server.stop()
