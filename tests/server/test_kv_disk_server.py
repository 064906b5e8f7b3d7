"""The disk tier (--kv-disk) through the real server, against mlx_lm: a long prompt
served from disk after a restart (plain, sliding-window and recurrent models), a
prompt evicted from memory read back, every kind of damaged file a logged miss, a
full disk, two servers on one directory, SIGKILLs while writing, `mlxd cache`."""

import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from mlxd.client import Client
from mlxd.model_store.tiny import TinySpec, build_tiny_model, hybrid_spec
from mlxd.runtime.kv_disk import KVDiskStore, parse_name
from support import ROOT, Server, reference_tokens, wait_until

LONG = 4000   # the restart test's prompt
SHORT = 600   # the fault tests'
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> a tiny model with room for a 4,000-token prompt."""
    root = tmp_path_factory.mktemp("disk-models")
    plain = TinySpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, intermediate_size=256, vocab_size=512, seed=3,
                     max_position_embeddings=8192)
    specs = {"plain": plain,
             "window": replace(hybrid_spec("gemma3_text"), max_position_embeddings=8192),
             "hybrid": replace(hybrid_spec("qwen3_next"), max_position_embeddings=8192)}
    return {kind: str(build_tiny_model(root / kind, spec)) for kind, spec in specs.items()}


def ids_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def disk_server(model: str, folder: Path, *args: str) -> Server:
    return Server(model, "--kv-disk", str(folder), "--kv-capacity", "12000",
                  "--log-level", "info", *args)


def generate(server: Server, ids: list[int]):
    with Client(server.address, timeout=300) as c:
        return c.generate(input_ids=ids, max_tokens=MAX_TOKENS, logprobs=True)


def assert_exact(model: str, ids: list[int], result) -> None:
    ref = reference_tokens(model, ids, MAX_TOKENS)
    assert result.token_ids == [t for t, _ in ref]
    assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3


def exact_answers(server: Server, model: str, prompts: list[list[int]]) -> list:
    """Each prompt's result in turn, the server then stopped (cleanly), every result
    equal to mlx_lm's."""
    try:
        results = [generate(server, ids) for ids in prompts]
    finally:
        stopped(server)
    for ids, result in zip(prompts, results):
        assert_exact(model, ids, result)
    return results


def entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*/*") if parse_name(p.name) is not None)


def stopped(server: Server) -> None:
    assert server.stop() == 0, "\n".join(server.stderr_lines[-30:])


@pytest.mark.parametrize("kind", ["plain", "window", "hybrid"])
def test_a_long_prompt_is_served_from_disk_after_a_restart(models, tmp_path, kind):
    model, ids = models[kind], ids_of(LONG, seed=1)
    first = disk_server(model, tmp_path / "kv")
    try:
        cold = generate(first, ids)
    finally:
        stopped(first)
    assert cold.usage["cached_tokens"] == 0
    assert sum(parse_name(p.name)[2] for p in entries(tmp_path / "kv")) >= LONG - 16
    second = disk_server(model, tmp_path / "kv")
    try:
        warm = generate(second, ids)
        with Client(second.address) as c:
            disk = c.stats()["disk"]
    finally:
        stopped(second)
    assert warm.usage["cached_tokens"] >= LONG - 32
    assert warm.usage["disk_tokens"] == warm.usage["cached_tokens"]
    assert disk["hit_tokens"] == warm.usage["disk_tokens"] and disk["missed_tokens"] == 0
    assert_exact(model, ids, cold)
    assert_exact(model, ids, warm)


def test_usage_and_metrics_count_disk_hits_apart(models, tmp_path):
    model = models["plain"]
    words = " ".join(random.Random(4).choice(["alpha", "beta", "gamma", "delta"])
                     for _ in range(300))
    for round_ in range(2):
        server = disk_server(model, tmp_path / "kv")
        try:
            client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none",
                                   max_retries=0)
            done = client.completions.create(model="plain", prompt=words, max_tokens=4,
                                              temperature=0)
            metrics = httpx.get(f"{server.http_url}/metrics").text
        finally:
            stopped(server)
        details = done.usage.prompt_tokens_details
        if round_ == 0:
            assert details.cached_tokens == 0
            continue
        assert details.cached_tokens >= 256 and \
            details.model_extra["disk_cached_tokens"] == details.cached_tokens
        hits = [line for line in metrics.splitlines()
                if line.startswith("mlxd_prefix_cache_disk_hit_tokens_total")]
        assert hits and float(hits[0].split()[-1]) == details.cached_tokens


def test_a_prompt_evicted_from_memory_comes_back_from_disk(models, tmp_path):
    model = models["plain"]
    a, b = ids_of(1000, seed=5), ids_of(1000, seed=6)
    server = Server(model, "--kv-disk", str(tmp_path / "kv"), "--kv-capacity", "1300",
                    "--log-level", "info")
    results = exact_answers(server, model, [a, b, a, b])
    for result in results[2:]:   # each evicted the other from the pool
        assert result.usage["cached_tokens"] >= 976
        assert result.usage["disk_tokens"] == result.usage["cached_tokens"]


@pytest.fixture(scope="module")
def written(models, tmp_path_factory):
    """A directory the plain model's server wrote SHORT's prompt to, and a file
    another model's server wrote."""
    root = tmp_path_factory.mktemp("written")
    ids = ids_of(SHORT, seed=7)
    for kind in ("plain", "window"):
        server = disk_server(models[kind], root / kind)
        try:
            generate(server, ids)
        finally:
            stopped(server)
    return root, ids


def damage(path: Path, how: str, foreign: Path) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 3])
    elif how == "bit-flipped":
        path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:])
    elif how == "foreign":   # another model's entry under this one's name
        shutil.copyfile(foreign, path)
    elif how == "unreadable":   # a FIFO: a blocking read would hang the worker
        path.unlink()
        os.mkfifo(path)
    elif how == "oversized":
        path.write_bytes(data + b"\0" * (2 << 20))


@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "foreign", "unreadable",
                                 "oversized"])
def test_a_damaged_entry_is_a_logged_miss_and_the_output_stays_exact(models, written,
                                                                     tmp_path, how):
    root, ids = written
    folder = tmp_path / "kv"
    shutil.copytree(root / "plain", folder)
    files = entries(folder)
    victim = files[["truncated", "bit-flipped", "foreign", "unreadable",
                    "oversized"].index(how) % len(files)]
    args = ("--kv-disk-max-gb", str(1 / 1024)) if how == "oversized" else ()
    server = disk_server(models["plain"], folder, *args)
    try:   # damaged once the server has listed it: the read finds it so
        damage(victim, how, entries(root / "window")[0])
        worker = server.child("worker_proc")
        result = generate(server, ids)
        again = generate(server, ids)   # and it keeps serving
        assert server.child("worker_proc") == worker
    finally:
        stopped(server)
    assert_exact(models["plain"], ids, result)
    assert_exact(models["plain"], ids, again)
    assert result.usage["disk_tokens"] == 0
    log = "\n".join(server.stderr_lines)
    assert "is not usable" in log and victim.name in log
    assert_all_readable(folder)   # the damaged entry removed (and written again whole)


def assert_all_readable(folder: Path) -> None:
    """Every entry in the directory passes every check of a read."""
    for fprint in {p.parent.name for p in entries(folder)}:
        store = KVDiskStore(folder, fprint, 1 << 30)
        try:
            for name in list(store.index.entries):
                assert store.get(name) is not None, f"{name} is damaged"
        finally:
            store.close()


def test_a_full_disk_skips_writes_and_serves_on(models, tmp_path):
    # every process of the server may write files of at most 64 KiB: entries fail
    limit = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
             "(65536, 65536)); os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    ids = ids_of(SHORT, seed=8)
    server = Server(models["plain"], "--kv-disk", str(tmp_path / "kv"), "--kv-capacity",
                    "12000", "--log-level", "info",
                    command=[sys.executable, "-c", limit, str(ROOT / "launch.py")])
    try:
        first, second = generate(server, ids), generate(server, ids)
        with Client(server.address) as c:
            assert wait_until(lambda: c.stats()["disk"]["entries"] == 0, 10)
    finally:
        stopped(server)
    assert_exact(models["plain"], ids, first)
    assert_exact(models["plain"], ids, second)
    assert entries(tmp_path / "kv") == [] and not list((tmp_path / "kv").glob("*/*.tmp"))
    assert "could not write" in "\n".join(server.stderr_lines)


def test_a_draft_model_drafts_from_prompts_read_from_disk(models, tmp_path):
    """--draft-model (the model drafting for itself) with a disk tier: after a
    restart the model reads the prompt from disk, and the draft model, whose pool
    holds none of it, computes those tokens itself; its drafts are then the
    model's own greedy choices (all accepted), and the output mlx_lm's."""
    model, ids = models["plain"], ids_of(SHORT, seed=31)
    draft = ("--draft-model", model, "--spec-cost", "none")
    exact_answers(disk_server(model, tmp_path / "kv", *draft), model, [ids])
    second = disk_server(model, tmp_path / "kv", *draft)
    try:
        with Client(second.address, timeout=300) as c:
            warm = c.generate(input_ids=ids, max_tokens=48, logprobs=True)
            spec = c.stats()["speculative"]
    finally:
        stopped(second)
    assert warm.usage["disk_tokens"] >= SHORT - 32
    ref = reference_tokens(model, ids, 48)
    assert warm.token_ids == [t for t, _ in ref]
    assert spec["method"] == "draft" and spec["draft_tokens"] >= 16
    assert spec["accepted_tokens"] == spec["draft_tokens"], spec


def test_a_second_server_on_the_same_directory_is_refused(models, tmp_path):
    first = disk_server(models["plain"], tmp_path / "kv")
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "--model", models["plain"],
             "--kv-disk", str(tmp_path / "kv"), "--port", "0", "--http-port", "0"],
            capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert "in use by another mlxd server" in done.stderr
        ids = ids_of(100, seed=9)
        assert_exact(models["plain"], ids, generate(first, ids))
    finally:
        stopped(first)


def test_sigkill_while_writing_never_leaves_a_corrupt_entry_loaded(models, tmp_path):
    model, folder = models["plain"], tmp_path / "kv"
    prompts = [ids_of(1500, seed=20 + k) for k in range(3)]
    for k in range(3):   # each server is killed as its last prompt's KV is spilled
        server = disk_server(model, folder)
        try:
            generate(server, prompts[k])
            os.killpg(server.proc.pid, signal.SIGKILL)
        finally:
            server.stop()
    exact_answers(disk_server(model, folder), model, prompts)
    assert not list(folder.glob("*/*.tmp"))   # interrupted writes removed at start
    assert entries(folder)
    assert_all_readable(folder)


def test_mlxd_cache_ls_and_clear(models, written, tmp_path):
    root, _ = written
    folder = tmp_path / "kv"
    shutil.copytree(root / "plain", folder)
    n = len(entries(folder))

    def cache(*args):
        return subprocess.run([sys.executable, str(ROOT / "launch.py"), "cache", *args],
                              capture_output=True, text=True, timeout=60)

    listed = cache("ls", str(folder))
    assert listed.returncode == 0 and f"  {n}  " in listed.stdout
    server = disk_server(models["plain"], folder)
    try:
        refused = cache("clear", str(folder))
        assert refused.returncode == 1 and "in use by another mlxd server" in refused.stderr
    finally:
        stopped(server)
    cleared = cache("clear", str(folder))
    assert cleared.returncode == 0 and f"removed {n} entries" in cleared.stdout
    assert entries(folder) == []


def test_a_restarted_worker_reopens_the_directory_and_reads_it(models, tmp_path):
    model, ids = models["plain"], ids_of(SHORT, seed=10)
    server = disk_server(model, tmp_path / "kv")
    try:
        generate(server, ids)
        old = server.child("worker_proc")
        os.kill(old, signal.SIGKILL)   # its lock goes with it
        assert wait_until(lambda: _new_worker(server, old), 120)
        with Client(server.address, timeout=120) as c:
            assert wait_until(lambda: _serves(c), 120)
        result = generate(server, ids)
    finally:
        stopped(server)
    assert result.usage["disk_tokens"] == result.usage["cached_tokens"] >= SHORT - 16 - 1
    assert_exact(model, ids, result)


def _new_worker(server: Server, old: int) -> bool:
    try:
        return server.child("worker_proc") != old
    except LookupError:
        return False


def _serves(c: Client) -> bool:
    try:
        return c.generate(input_ids=[11, 12], max_tokens=1).finish_reason is not None
    except Exception:
        return False


def test_replicas_each_keep_a_directory_of_their_own(models, tmp_path):
    """--dp 2 --kv-disk DIR: each engine opens DIR/MODEL-REPLICA (one server per
    directory), and `mlxd cache ls DIR` lists both. After a restart the router knows
    what each replica's disk holds: every prompt goes to the replica that wrote it
    and is read back from its disk."""
    model, folder = models["plain"], tmp_path / "kv"
    prompts = [ids_of(300, seed=60 + k) for k in range(4)]
    flags = ("--dp", "2", "--kv-disk", str(folder), "--kv-capacity", "4096",
             "--log-level", "info")
    exact_answers(Server(model, *flags), model, prompts)
    engines = sorted(p.name for p in folder.iterdir() if p.is_dir())
    assert engines == ["plain-0", "plain-1"]
    assert all((folder / e / "lock").exists() for e in engines)
    assert all(entries(folder / e) for e in engines)   # the prompts went to both
    listed = subprocess.run([sys.executable, str(ROOT / "launch.py"), "cache", "ls",
                             str(folder)], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    assert "plain-0/" in listed.stdout and "plain-1/" in listed.stdout

    def known_ends(c: Client) -> int:
        return sum(e["routing_disk_ends"] for e in c.stats()["engines"].values())

    server = Server(model, *flags)
    try:
        with Client(server.address, timeout=60) as c:
            assert wait_until(lambda: known_ends(c) == sum(len(entries(folder / e))
                                                           for e in engines), 60)
            results = [generate(server, ids) for ids in prompts]
            assert c.stats()["router"]["decisions"] == {"disk": len(prompts)}
    finally:
        stopped(server)
    for ids, result in zip(prompts, results):
        assert_exact(model, ids, result)
        assert result.usage["disk_tokens"] >= 288, result.usage
