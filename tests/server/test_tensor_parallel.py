"""A tensor-parallel worker group (`--tp 2`, a ring over 127.0.0.1), on real processes:
greedy tokens and logprobs equal mlx_lm's single-process generation (concurrent, alone,
with a prefix hit, chunked, with a tight pool); seeded sampling equals one rank's; each
rank holds about half the layers' weights; a rank killed or stopped under load: every
request answered, the group restarted, exact again; models that cannot be split are
refused before anything starts."""

import json
import os
import signal
import subprocess
import sys

import mlx.core as mx
import pytest

from group_support import (MAX_TOKENS, assert_exact, hostfile_group, lose_a_rank, prompts,
                           refused_at_start, run_all, serves_exactly)
from mlxd.client import Client, MlxdError
from support import ROOT, Server, children_of, wait_until


@pytest.fixture(scope="module")
def tp2(llama_model):
    server = Server(llama_model, "--tp", "2", "--kv-capacity", "4096", "--speculative", "off",
                    "--log-level", "warning")
    yield server
    server.stop()


def test_two_ranks_decode_exactly_as_mlx_lm(tp2, llama_model):
    worker = serves_exactly(tp2, llama_model)
    assert worker["tensor_parallel"] == 2 and worker["overlap"]


def test_without_overlap_too(llama_model):
    server = Server(llama_model, "--tp", "2", "--kv-capacity", "4096", "--speculative",
                    "off", "--disable-overlap", "--log-level", "warning")
    try:
        batch = prompts(6, seed=21)
        for ids, result in zip(batch, run_all(server.address, batch, 40)):
            assert_exact(llama_model, ids, result, 40)   # 40 steps: digests compared
    finally:
        server.stop()


def test_a_tight_pool_retracts_and_resumes_exactly(llama_model):
    # 3 pages of 64: two requests of 40 prompt tokens run, and each needs a second
    # page as its output passes position 64
    server = Server(llama_model, "--tp", "2", "--kv-capacity", "192", "--speculative",
                    "off", "--log-level", "warning")
    try:
        batch = prompts(6, length=40, seed=31)
        for ids, result in zip(batch, run_all(server.address, batch, 30)):
            assert_exact(llama_model, ids, result, 30)
        with Client(server.address, timeout=60) as c:
            assert c.stats()["retractions"] > 0
    finally:
        server.stop()


def test_seeded_sampling_equals_one_rank(tp2, llama_server):
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    batch = prompts(4, seed=3)
    two = run_all(tp2.address, batch, 16, **params)
    one = run_all(llama_server.address, batch, 16, **params)
    assert [r.token_ids for r in two] == [r.token_ids for r in one]


def test_each_rank_holds_about_half_of_the_layers(tp2, llama_server):
    with Client(tp2.address, timeout=60) as c:
        split = c.stats()["worker"]["weights_bytes"]
    with Client(llama_server.address, timeout=60) as c:
        whole = c.stats()["worker"]["weights_bytes"]
    assert split < 0.8 * whole   # the layers halve; embeddings and head stay whole


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_rank_restarts_the_group_and_every_request_is_answered(llama_model, how):
    lose_a_rank(llama_model, how, "--tp", "2")


@pytest.mark.parametrize("model,tp,says", [
    ("llama", "4", "2 key/value heads do not divide over 4 ranks"),
    ("llama", "3", "4 attention heads do not divide over 3 ranks"),
    ("mamba2", "2", "has no tensor-parallel split"),
])
def test_models_that_cannot_be_split_are_refused_before_anything_starts(
        llama_model, hybrid_model, model, tp, says):
    path = llama_model if model == "llama" else hybrid_model(model)
    stderr = refused_at_start("--model", path, "--tp", tp)
    assert says in stderr, stderr[-2000:]
    assert "worker" not in stderr.split(says)[0].lower().replace("worker group", "")


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_other_architectures_split_exactly(arch, qwen3_model, hybrid_model):
    """qwen3 (plain attention, q/k norms) and gpt_oss (sliding-window layers and
    experts, each rank holding half of every expert)."""
    path = qwen3_model if arch == "qwen3" else hybrid_model(arch)
    server = Server(path, "--tp", "2", "--kv-capacity", "4096", "--speculative", "off",
                    "--log-level", "warning")
    try:
        batch = prompts(4, seed=41)
        for ids, result in zip(batch, run_all(server.address, batch, 20)):
            assert_exact(path, ids, result, 20)
    finally:
        server.stop()


def test_ranks_on_other_machines_join_through_a_hostfile(llama_model, tmp_path):
    """`--hostfile` with two hosts (both 127.0.0.1 here): rank 0 runs with the server,
    rank 1 under `mlxd rank`, its Steps over TCP with CURVE. Exact; a rank's worker
    killed: `mlxd rank` starts another, the server restarts rank 0, the group forms
    again and serves exactly."""
    with hostfile_group(llama_model, tmp_path) as (server, rank, _):
        batch = prompts(6, seed=51)
        for ids, result in zip(batch, run_all(server.address, batch, 20)):
            assert_exact(llama_model, ids, result, 20)
        remote = [p for p in children_of(rank.pid)]
        assert len(remote) == 1
        os.kill(remote[0], signal.SIGKILL)
        def replaced() -> bool:   # a new worker under `mlxd rank` (it may end and be
            kids = children_of(rank.pid)   # replaced again while rank 0 restarts)
            return bool(kids) and remote[0] not in kids
        assert wait_until(replaced, 30)
        ids = prompts(1, seed=52)[0]

        def serves() -> bool:
            try:
                with Client(server.address, timeout=30) as c:
                    result = c.generate(input_ids=ids, max_tokens=MAX_TOKENS)
            except MlxdError:
                return False
            return result.finish_reason == "length"
        assert wait_until(serves, 90, 1.0)
        with Client(server.address, timeout=60) as c:
            assert_exact(llama_model, ids, c.generate(input_ids=ids, max_tokens=MAX_TOKENS,
                                                      logprobs=True))


@pytest.mark.parametrize("hosts,args,says", [
    ('[{"ips": ["127.0.0.1"]}]', [], "at least 2 hosts"),
    ('{"backend": "mpi", "hosts": []}', [], "backend 'mpi' is not served"),
    ('[{"ssh": "a"}, {"ssh": "b"}]', [], "give its address in"),
    ('[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]', ["--tp", "3"], "lists 2 hosts"),
])
def test_hostfiles_that_cannot_place_a_group_are_refused(llama_model, tmp_path, hosts, args,
                                                         says):
    (tmp_path / "h.json").write_text(hosts)
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", llama_model,
                           "--hostfile", str(tmp_path / "h.json"), "--port", "0",
                           "--http-port", "0", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(mx.distributed.is_available("jaccl"), reason="JACCL would wait for peers")
def test_a_jaccl_group_where_jaccl_cannot_run_says_why(llama_model, tmp_path):
    """A valid JACCL hostfile on a machine without RDMA over Thunderbolt: rank 0
    cannot join, and the server exits saying what JACCL needs."""
    rdma = [[None, "rdma_en2"], ["rdma_en2", None]]
    (tmp_path / "h.json").write_text(json.dumps({"backend": "jaccl", "hosts": [
        {"ssh": f"m{i}", "ips": ["127.0.0.1"], "rdma": rdma[i]} for i in range(2)]}))
    stderr = refused_at_start("--model", llama_model, "--hostfile", str(tmp_path / "h.json"))
    assert "the jaccl backend of mx.distributed cannot start here" in stderr, stderr[-2000:]
    assert "macOS 26.2 or later with RDMA over Thunderbolt 5" in stderr


@pytest.mark.parametrize("args,says", [
    (["--rank", "2"], "--rank must be in [1, 1]"),
    (["--rank", "1"], "--curve-secret-key (the server's key file) is required"),
])
def test_a_rank_that_cannot_join_is_refused(llama_model, tmp_path, args, says):
    (tmp_path / "h.json").write_text('[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]')
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "rank", "--hostfile",
                           str(tmp_path / "h.json"), "--model", llama_model, *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


def test_constraints_and_penalties_run_as_on_one_process(tp2, llama_server):
    """A grammar (regex), penalties and min_tokens: the group's output equals one
    process's, greedy and seeded."""
    batch = prompts(3, seed=61)
    cases = [dict(response_format={"type": "regex", "regex": "[a-z ]{4,20}"},
                  max_tokens=24),
             dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                  min_tokens=10, max_tokens=16),
             dict(temperature=0.8, seed=5, top_k=20, repetition_penalty=1.1,
                  max_tokens=16)]

    def outputs(address):
        with Client(address, timeout=120) as c:
            return [c.generate(input_ids=ids, **case).token_ids
                    for ids in batch for case in cases]
    assert outputs(tp2.address) == outputs(llama_server.address)
