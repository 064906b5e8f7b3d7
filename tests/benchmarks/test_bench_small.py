"""bench/codec.py and bench/blas_speed.py: quick runs print their figures."""

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
