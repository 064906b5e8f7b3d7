"""Worker supervision: a dead worker is replaced by a new one, its running requests
resume on it (a request running at a second death ends with an error), and the
server serves again without clients reconnecting; a worker that keeps dying, or one
that dies while loading, stops the server."""

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from mlxd.client import Client
from mlxd.launcher import RestartBudget
from support import Server, children_of, pid_alive, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find child processes")

STREAMS = 6
PROMPT = "The quick brown fox jumps over the lazy dog and then"
LOST = "worker process died"   # in the error of a request the dead worker ran


def test_the_restart_budget_counts_restarts_within_its_window():
    budget = RestartBudget(2, window=10.0)
    assert budget.take(0.0) and budget.take(1.0)
    assert not budget.take(5.0)           # a third within 10 s
    assert budget.take(10.0)              # the first one left the window
    assert not budget.take(10.5)
    assert not RestartBudget(0).take(0.0)


def kill_worker(server: Server) -> int:
    pid = server.child("worker_proc")
    os.kill(pid, signal.SIGKILL)
    return pid


def serving_again(client: Client, restarts: int) -> bool:
    """The scheduler counted `restarts` deaths and has a ready worker again."""
    stats = client.stats()
    return stats["worker_restarts"] == restarts and stats["worker_status"] == "ok"


def assert_no_slot_leaked(client: Client) -> None:
    assert wait_until(lambda: client.stats()["running"] == 0, 30)
    stats = client.stats()
    assert stats["used_slots"] == 0, stats
    assert stats["free_slots"] + stats["cached_slots"] == stats["capacity"], stats


@pytest.fixture
def server(llama_model):
    s = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning")
    yield s
    s.stop()


def test_a_killed_worker_is_replaced_and_a_request_running_at_two_deaths_ends(server):
    """Streams running at the first death resume on the new worker; those running at
    the second end with an error naming both."""
    scheduler, tokenizer = server.child("scheduler_proc"), server.child("tokenizer_proc")
    with Client(server.address, timeout=60) as c, Client(server.address, timeout=30) as load:
        before = c.generate(PROMPT, max_tokens=12, ignore_eos=True)
        streams = [load.stream("Once upon a time", max_tokens=100000, ignore_eos=True)
                   for _ in range(STREAMS)]
        for stream in streams:
            next(stream)                  # each one is running
        kill_worker(server)
        assert wait_until(lambda: serving_again(c, 1), 60), server.stderr_lines[-20:]
        # each one runs again (resumed, not failed) before the second death
        assert wait_until(lambda: c.stats()["running"] == STREAMS, 30), c.stats()
        old = kill_worker(server)
        # no reply for 30 s would raise the SDK's timeout: every error comes sooner
        lasts = [list(stream)[-1] for stream in streams]
        for last in lasts:
            assert last.finish_reason == "error" and LOST in last.error, last
            assert "2 failures in a row" in last.error and last.usage["resumes"] == 1
        assert wait_until(lambda: serving_again(c, 2), 60), server.stderr_lines[-20:]
        after = c.generate(PROMPT, max_tokens=12, ignore_eos=True)
        assert after.token_ids == before.token_ids   # greedy: the same tokens
        assert after.usage["cached_tokens"] == 0     # the new worker's cache starts empty
        assert_no_slot_leaked(c)
    assert server.proc.poll() is None
    assert pid_alive(scheduler) and pid_alive(tokenizer)
    assert server.child("worker_proc") != old
    assert sum("worker process exited with code -9; starting a new one" in line
               for line in server.stderr_lines) == 2


def test_a_worker_that_keeps_dying_stops_the_server(llama_model):
    server = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning",
                    "--worker-restarts", "1")
    try:
        with Client(server.address, timeout=60) as c:
            kill_worker(server)
            assert wait_until(lambda: serving_again(c, 1), 60), server.stderr_lines[-20:]
            kill_worker(server)
            server.proc.wait(30)
        assert server.proc.returncode != 0
        assert any("(--worker-restarts)" in line for line in server.stderr_lines)
        assert wait_until(lambda: not any(pid_alive(p) for p in server.child_pids), 10)
    finally:
        server.stop()


def test_a_new_worker_that_fails_to_load_stops_the_server(tmp_path, llama_model):
    model = tmp_path / "model"
    shutil.copytree(llama_model, model)
    server = Server(str(model), "--kv-capacity", "4096", "--log-level", "warning")
    try:
        for weights in Path(model).glob("*.safetensors"):
            weights.unlink()              # the next worker cannot load the model
        kill_worker(server)
        server.proc.wait(60)
        assert server.proc.returncode != 0
        assert any("before it was ready" in line for line in server.stderr_lines)
        assert not children_of(server.proc.pid)
    finally:
        server.stop()
