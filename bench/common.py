"""Shared pieces of the benchmarks: the bench model, workloads, a server handle."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from mlxd.launcher import HTTP_PREFIX, READY_PREFIX, read_ready_addresses
from mlxd.model_store.tiny import TinySpec, build_tiny_model, default_cache_dir

# ~40M parameters: hidden 512, 8 layers, vocab 32000, tied embeddings.
BENCH_SPEC = TinySpec(arch="llama", hidden_size=512, num_layers=8, num_heads=8,
                      num_kv_heads=8, intermediate_size=1408, vocab_size=32000,
                      tie_word_embeddings=True, seed=7)


def bench_model(path: str | None) -> str:
    """A model folder: the given one, "smollm2" (the server's default model), or
    the ~40M random-weight bench model."""
    if path == "smollm2":
        from mlxd.model_store.default_model import ensure_default_model

        return str(ensure_default_model(default_cache_dir()))
    if path:
        return path
    return str(build_tiny_model(default_cache_dir() / "bench-llama-h512-l8-v32000", BENCH_SPEC))


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def tokenizer_vocab(model_path: str) -> int:
    import json

    return len(json.loads((Path(model_path) / "tokenizer.json").read_text())["model"]["vocab"])


def rerun_with_worker_blas(module: str) -> None:
    """Re-execute `python -m module` with the worker's BLAS preloaded (Linux), unless
    it already is: a library preloaded at start is the only way to swap it."""
    env = blas_env()
    if env.get("LD_PRELOAD") and os.environ.get("LD_PRELOAD") != env["LD_PRELOAD"]:
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def blas_env() -> dict:
    """The environment the launcher gives its worker: the same BLAS for every system."""
    from mlxd.runtime.blas import find_blas

    env = dict(os.environ)
    blas = find_blas("auto")
    if blas:
        env["LD_PRELOAD"] = blas
    return env


def add_workload_arguments(ap) -> None:
    """N concurrent requests of P prompt + G output tokens, repeated, on a model
    (None: the bench's default) with extra server flags."""
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--server-args", default="", help="extra launch.py flags")


class MlxdServer:
    def __init__(self, model: str, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--model", model, "--port", "0",
             "--http-port", "0", "--log-level", "warning", *args],
            cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:   # an interrupted wait (Ctrl-C, SIGTERM) must not leave the launcher running
            found = read_ready_addresses(self.proc.stdout, 600)
        except BaseException:
            self.stop()
            raise
        self.address, self.http_url = found.get(READY_PREFIX), found.get(HTTP_PREFIX)
        if self.address is None:
            self.stop()
            raise RuntimeError("mlxd did not start")

    def cpu_seconds(self) -> dict[str, float] | None:
        """CPU time (user + system) used so far by each server process, by module
        (worker_proc, scheduler_proc, tokenizer_proc); None where /proc is missing."""
        return process_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def process_cpu_seconds(launcher_pid: int) -> dict[str, float] | None:
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
            children = f.read().split()
    except OSError:   # not Linux
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        module = argv[argv.index("-m") + 1].removeprefix("mlxd.") if "-m" in argv else argv[0]
        out[module] = (int(fields[11]) + int(fields[12])) / ticks   # utime + stime
    return out


def machine_summary() -> str:
    import platform

    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"


def now() -> float:
    return time.perf_counter()


async def timed_stream(client, ids: list[int], max_tokens: int) -> tuple:
    """One streamed request of `ids` (ignore_eos) through the async SDK: (when its
    first token came, when it ended, its tokens, its last usage), times by now();
    an error chunk raises."""
    first, tokens, usage = None, 0, {}
    async for chunk in client.stream(input_ids=ids, max_tokens=max_tokens, ignore_eos=True):
        if chunk.error:
            raise RuntimeError(chunk.error)
        if chunk.token_ids and first is None:
            first = now()
        tokens += len(chunk.token_ids)
        usage = chunk.usage or usage
    return first, now(), tokens, usage
