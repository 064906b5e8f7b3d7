"""bench/codec.py, bench/blas_speed.py, bench/capacity.py and bench/prefix.py
--half-cached: quick runs print their figures."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_codec_bench_reports_each_message():
    out = subprocess.run([sys.executable, "-m", "bench.codec", "--rows", "4", "--repeats", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    names = [line.split()[0] for line in out.stdout.splitlines() if "encode + decode" in line]
    assert names == ["Step", "StepResult", "TokenBatch"]


def test_blas_speed_bench_reports_a_rate(llama_model):
    out = subprocess.run([sys.executable, "-m", "bench.blas_speed", llama_model], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[0]) > 0 and "tok/s decode" in out.stdout


def test_capacity_bench_reports_the_pools_share_of_the_memory(llama_model, tmp_path):
    """In pages the pool is the split's one KV term: nearly all the memory left after
    the weights and the activation reserve holds KV (the ceiling raised out of the way);
    three concurrent requests then run, all of them at once, none retracted."""
    out = subprocess.run([sys.executable, "-m", "bench.capacity", "--model", llama_model,
                          "--limits", "0.6", "--kv-bits", "0", "--json", str(tmp_path / "c.json"),
                          "--server-args", "--max-running-requests 512", "--chats", "3",
                          "--chat-tokens", "40", "--max-tokens", "100"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert row["kv_bits"] == 0 and row["kv_capacity"] % 64 == 0
    assert 0.9 <= row["share"] <= 1.0, row
    assert row["chats"] == 3 and row["retractions"] == 0 and row["all_at_once"], row


def test_half_cached_prefix_bench_reports_both_ttfts(llama_model, tmp_path):
    """bench/prefix.py --half-cached: the second prompt's first half is served from the
    cache (cached_tokens), both first-token times are measured."""
    out = subprocess.run([sys.executable, "-m", "bench.prefix", "--model", llama_model,
                          "--half-cached", "--restart-len", "200",
                          "--json", str(tmp_path / "p.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["cached"] == 100 and report["cold_s"] > 0 and report["half_cached_s"] > 0
    assert report["half_cached_second_token_s"] >= report["half_cached_s"]
    assert report["cold_second_token_s"] >= report["cold_s"]
