"""bench/overhead.py: a small run against mlxd and in-process mlx_lm, with the
per-process CPU accounting and the in-process run under the other processes' load."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import processes_using, wait_until

ROOT = Path(__file__).resolve().parents[2]
from bench.common import MlxdServer, process_cpu_seconds

TINY = TinySpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, vocab_size=512, max_position_embeddings=1024)
HAS_PROC = Path(f"/proc/self/task/{os.getpid()}/children").exists()   # what cpu_seconds reads
BURNER_MARK = "period - busy"   # a line of overhead.BURNER, in the burners' command line


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("overhead") / "tiny", TINY))


@pytest.mark.skipif(not HAS_PROC, reason="per-process CPU time comes from /proc")
def test_server_cpu_seconds_name_every_process_and_grow(tiny_model):
    server = MlxdServer(tiny_model)
    try:
        first = server.cpu_seconds()
        assert set(first) == {"worker_proc", "scheduler_proc", "tokenizer_proc"}
        from mlxd.client import Client

        with Client(server.address, timeout=60) as c:
            c.generate(input_ids=[5, 6, 7], max_tokens=40, ignore_eos=True)
        later = server.cpu_seconds()
        assert all(later[p] >= first[p] for p in first)
        assert later["worker_proc"] > first["worker_proc"]
    finally:
        server.stop()
    assert not process_cpu_seconds(server.proc.pid)   # stopped: no process left to count


def test_overhead_bench_runs_and_reports_every_figure(tiny_model, tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.overhead", "--model", tiny_model,
         "--gen-len", "24", "--prompt-len", "8", "--repeats", "1", "--json", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"bench/overhead.py timed out:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    rates = report["decode_tok_s"]
    expected = {"in_process", "overlap_on", "overlap_off"} | ({"in_process_loaded"} if HAS_PROC else set())
    assert set(rates) == expected and all(r > 0 for r in rates.values())
    assert report["ratio_overlap_on"] == pytest.approx(rates["overlap_on"] / rates["in_process"])
    for name in ("overlap_on", "overlap_off"):   # one repeat: its ratio is the medians'
        assert report["paired_ratios"][name] == pytest.approx([rates[name] / rates["in_process"]])
    assert "per repeat" in stdout
    for name in ("overlap_on", "overlap_off"):
        timing = report["step_timing_p50_ms"][name][0]
        assert timing["compute_ms"] > 0
    if HAS_PROC:
        for name in ("overlap_on", "overlap_off"):
            cpu = report["cpu_ms_per_token"][name]
            assert set(cpu) == {"worker", "scheduler", "tokenizer", "client"}
            assert cpu["worker"] > 0 and all(ms >= 0 for ms in cpu.values())
        # the busiest thread of the reference child and of each worker: kernels ran on it
        for name in ("in_process", "overlap_on", "overlap_off"):
            (top,) = report["busiest_thread_ms_per_token"][name]
            assert top["ms_per_token"] > 0 and 0 < top["busy"] <= 1.05 + top["busy_error"]
        assert "busiest thread" in stdout
        assert report["ratio_loaded_in_process"] == pytest.approx(
            rates["in_process_loaded"] / rates["in_process"])
        assert "burnt alongside" in stdout
    # no server, in-process child or burner is left behind
    assert wait_until(lambda: not processes_using(tiny_model), 10), processes_using(tiny_model)
    assert wait_until(lambda: not processes_using(BURNER_MARK), 10), processes_using(BURNER_MARK)


def test_a_burner_ends_when_the_process_that_started_it_is_killed():
    from bench.overhead import BURNER
    from support import pid_alive

    parent = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
burner = subprocess.Popen([sys.executable, "-c", {BURNER!r}, "0.5", "5", str(os.getpid())])
print(burner.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        burner = int(parent.stdout.readline())
        assert pid_alive(burner)
    finally:
        parent.kill()
        parent.wait()
    try:
        assert wait_until(lambda: not pid_alive(burner), 5)
    finally:
        if pid_alive(burner):   # do not leave it spinning if the test fails
            os.kill(burner, signal.SIGKILL)
