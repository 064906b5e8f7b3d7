"""bench/soak.py: a short soak against a tiny model reports every behaviour, no lost
chunk, no leaked slot, and each process's memory; it leaves no process behind."""

import subprocess
import sys
from pathlib import Path

from support import processes_using, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak(llama_model):
    out = subprocess.run([sys.executable, "-m", "bench.soak", "--model", llama_model,
                          "--duration", "6", "--clients", "7", "--kv-capacity", "1024"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "lost chunks 0, leaked slots 0" in out.stdout
    behaviours = {line.split()[0] for line in out.stdout.splitlines()
                  if line and not line.startswith(("#", "requests", "RSS"))}
    assert behaviours == {"stream", "generate", "abort", "vanish", "slow", "deadline", "timeout"}
    assert sum(line.startswith("RSS ") for line in out.stdout.splitlines()) == 3
    assert wait_until(lambda: not processes_using(llama_model), 10)
