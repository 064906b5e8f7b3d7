"""Process lifecycle: a dead child stops the server, signals stop it, no orphans ever."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxd.client import Client, MlxdError
from support import ROOT, Server, children_of, pid_alive, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find child processes")


def all_gone(pids) -> bool:
    return not any(pid_alive(p) for p in pids)


@pytest.fixture
def server(llama_model):
    s = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning")
    yield s
    s.stop()


@pytest.fixture
def no_restart_server(llama_model):
    """A server whose dead worker is not replaced: any child's death stops it."""
    s = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning",
               "--no-restart-worker")
    yield s
    s.stop()


def test_three_children_are_started(server):
    assert len(server.child_pids) == 3
    for name in ("worker_proc", "scheduler_proc", "tokenizer_proc"):
        assert server.child(name)


def test_sigkill_of_the_worker_stops_everything_with_an_error(no_restart_server):
    server = no_restart_server
    start = time.monotonic()
    os.kill(server.child("worker_proc"), signal.SIGKILL)
    server.proc.wait(10)
    assert time.monotonic() - start < 10
    assert server.proc.returncode != 0
    assert wait_until(lambda: all_gone(server.child_pids), 5)
    assert any("worker process exited" in line for line in server.stderr_lines)


def test_sigterm_shuts_down_cleanly(server):
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(6)
    assert time.monotonic() - start < 5.5
    assert server.proc.returncode == 0
    assert wait_until(lambda: all_gone(server.child_pids), 2)
    assert not any("did not stop in time" in line for line in server.stderr_lines)
    assert not any("Traceback" in line for line in server.stderr_lines)


def _signal_a_helper_thread(pid: int, sig: int) -> None:
    """Deliver `sig` to one of the process's threads other than its main thread, as
    the kernel may do with a process-directed signal (Linux tgkill)."""
    import ctypes

    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the process has no helper thread"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(234, pid, tids[0], sig) == 0   # SYS_tgkill on x86_64

@pytest.mark.skipif(os.uname().machine != "x86_64", reason="tgkill's syscall number")
@pytest.mark.parametrize("name", ["scheduler_proc", "worker_proc"])
def test_a_signal_caught_by_a_helper_thread_still_stops_the_process(server, name):
    with Client(server.address, timeout=30) as c:   # the worker's helper thread exists
        c.generate("hello", max_tokens=4)
    pid = server.child(name)
    _signal_a_helper_thread(pid, signal.SIGTERM)
    assert wait_until(lambda: not pid_alive(pid), 5), f"{name} ignored SIGTERM"
    server.proc.wait(10)   # the launcher notices and stops the rest
    assert wait_until(lambda: all_gone(server.child_pids), 5)
    assert not any("terminate called" in line for line in server.stderr_lines)


def test_sigterm_right_after_a_request_is_clean(server):
    with Client(server.address, timeout=30) as c:   # a chained decode may be computing
        c.generate("hello", max_tokens=8, ignore_eos=True)
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(6)
    assert server.proc.returncode == 0
    bad = [line for line in server.stderr_lines
           if "terminate called" in line or "did not stop in time" in line]
    assert not bad, "\n".join(server.stderr_lines[-40:])


def test_a_stop_while_requests_stream_reports_no_engine_lost(server):
    """The processes are stopped top down (front end, scheduler, worker), each gone
    before the next is told: the requests end with the server, and no process
    reports its peer lost (the front end an engine, the scheduler its worker) or
    logs anything at ERROR."""
    with Client(server.address, timeout=30) as c:
        streams = [iter(c.stream(f"hello {k}", max_tokens=3000, ignore_eos=True))
                   for k in range(3)]
        for stream in streams:
            next(stream)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(15)
    assert server.proc.returncode == 0
    assert wait_until(lambda: all_gone(server.child_pids), 5)
    lost = [line for line in server.stderr_lines if "was lost" in line or " ERROR " in line]
    assert not lost, "\n".join(server.stderr_lines[-40:])


def test_a_second_signal_does_not_cut_the_worker_s_clean_up_short(server):
    """Ctrl-C reaches the whole process group, then the launcher's SIGTERM follows:
    the worker, busy with a chained decode, must still exit cleanly."""
    with Client(server.address, timeout=30) as c:
        stream = c.stream("hello", max_tokens=3000, ignore_eos=True)
        next(iter(stream))
        pid = server.child("worker_proc")
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        assert wait_until(lambda: not pid_alive(pid), 5)
    # the launcher then stops the rest (a grace of seconds each): slow on a loaded
    # 2-core machine, which is not what this checks
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("the launcher did not stop; its last stderr lines:\n"
                    + "\n".join(server.stderr_lines[-30:]))
    assert not any("terminate called" in line or "Traceback" in line
                   for line in server.stderr_lines), server.stderr_lines[-20:]


def test_children_die_with_a_killed_launcher(server):
    server.proc.kill()
    server.proc.wait()
    assert wait_until(lambda: all_gone(server.child_pids), 10)


def test_in_flight_request_fails_when_the_server_dies(no_restart_server):
    """The stream ends in an error: the scheduler's report of the worker's death, or,
    should the server stop first, the lost connection."""
    server = no_restart_server
    with Client(server.address, timeout=30) as c:
        stream = c.stream("Hello", max_tokens=3000, ignore_eos=True)
        next(stream)
        os.kill(server.child("worker_proc"), signal.SIGKILL)
        try:
            last = list(stream)[-1]
        except MlxdError as err:
            assert err.code in ("disconnected", "timeout")
        else:
            assert last.finish_reason == "error" and "worker process died" in last.error
    server.proc.wait(10)
    assert server.proc.returncode != 0


def test_bad_model_path_exits_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "not a model folder" in proc.stderr


def test_a_child_that_fails_at_start_is_reported(tmp_path, llama_model):
    """An unloadable model makes the worker die; the launcher says so and exits non-zero."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((Path(llama_model) / name).read_bytes())
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--model", str(broken),
                             "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "worker process exited" in err
    assert not children_of(proc.pid)


def test_demo_model_is_built_and_served(tmp_path):
    env = {**os.environ, "MLXD_CACHE_DIR": str(tmp_path)}
    server = Server("demo", "--kv-capacity", "2048", "--log-level", "warning", env=env)
    try:
        with Client(server.address, timeout=60) as c:
            assert len(c.generate("Hello", max_tokens=5, ignore_eos=True).token_ids) == 5
        assert (tmp_path / "demo-llama-h256-l4-v1" / "config.json").exists()
    finally:
        server.stop()


def test_a_stopped_worker_s_request_waits_and_resumes_exactly_after_it(llama_model):
    """SIGSTOP on the worker: past --worker-timeout stats say so and the running
    request waits to resume; after SIGCONT it goes on with the tokens it would have
    had, and nothing leaks."""
    s = Server(llama_model, "--kv-capacity", "4096", "--log-level", "warning",
               "--worker-timeout", "3")
    worker = s.child("worker_proc")
    try:
        with Client(s.address, timeout=60) as c:
            want = c.generate("Hello", max_tokens=300, ignore_eos=True)
            stream = c.stream("Hello", max_tokens=300, ignore_eos=True)
            first = next(stream)
            os.kill(worker, signal.SIGSTOP)
            try:
                assert wait_until(lambda: c.stats()["worker_status"] == "unresponsive", 30)
                stats = c.stats()
                assert stats["running"] == 0 and stats["waiting"] == 1
                assert stats["resumes"] == 1
            finally:
                os.kill(worker, signal.SIGCONT)
            chunks = [first, *stream]
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage["resumes"] == 1
            assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
            stats = c.stats()
            assert stats["worker_status"] == "ok" and stats["running"] == 0
            assert stats["used_slots"] == 0   # no slot leaked
            assert stats["free_slots"] + stats["cached_slots"] == stats["capacity"]
        assert s.proc.poll() is None
    finally:
        if pid_alive(worker):
            os.kill(worker, signal.SIGCONT)
        s.stop()
