"""A pipeline-parallel worker group (`--pp 2`, a ring over 127.0.0.1), on real
processes: each rank holds a contiguous share of the layers (mlx_lm's
`model.model.pipeline()`), and greedy tokens and logprobs equal mlx_lm's
single-process generation (concurrent, alone, with a prefix hit, chunked, with a
tight pool, overlap on and off) for qwen2 and the qwen3_next hybrid; seeded sampling,
grammars and penalties equal one process's; a rank killed or stopped under load:
every request answered, the group restarted, exact again; models that cannot be
pipelined are refused with the reason."""

import dataclasses
from pathlib import Path

import pytest

from group_support import (MAX_TOKENS, assert_exact, hostfile_group, lose_a_rank, prompts,
                           rank_pids, refused_at_start, run_all, serves_exactly)
from mlxd.client import Client
from mlxd.model_store.tiny import TinySpec, build_tiny_model, hybrid_spec
from support import Server, children_of, send_raw_garbage

# transformers gives qwen2's tokenizer one more token (513): a model vocabulary larger
# than that, as real models have, lets llguidance read it (grammars)
QWEN2 = TinySpec(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=512, seed=2, extra=(("vocab_size", 520),))


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "qwen2", QWEN2))


@pytest.fixture(scope="module")
def pp2(qwen2_model):
    server = Server(qwen2_model, "--pp", "2", "--kv-capacity", "4096", "--speculative", "off",
                    "--log-level", "warning")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_process(qwen2_model):
    server = Server(qwen2_model, "--kv-capacity", "4096", "--speculative", "off",
                    "--log-level", "warning")
    yield server
    server.stop()


def test_two_stages_decode_exactly_as_mlx_lm(pp2, qwen2_model):
    worker = serves_exactly(pp2, qwen2_model)
    assert (worker["pipeline_parallel"], worker["tensor_parallel"]) == (2, 1)
    assert worker["overlap"]


def test_each_stage_holds_its_layers_only(pp2, one_process):
    """A stage's KV pool holds its layer's KV (one of two layers), and its weights
    are its layer's plus the embeddings and head every stage keeps."""
    with Client(pp2.address, timeout=60) as c:
        split = c.stats()["worker"]
    with Client(one_process.address, timeout=60) as c:
        whole = c.stats()["worker"]
    assert split["bytes_per_token"] * 2 == whole["bytes_per_token"]
    assert split["weights_bytes"] < 0.8 * whole["weights_bytes"]


@pytest.mark.parametrize("extra", [["--disable-overlap"], ["--kv-capacity", "192"]],
                         ids=["overlap-off", "tight-pool"])
def test_without_overlap_and_with_a_tight_pool(qwen2_model, extra):
    """The tight pool: 3 pages of 64, two requests of 40 prompt tokens running, each
    needing a second page as its output passes position 64."""
    server = Server(qwen2_model, "--pp", "2", "--kv-capacity", "4096", "--speculative",
                    "off", "--log-level", "warning", *extra)
    try:
        batch = prompts(6, length=40, seed=21)
        for ids, result in zip(batch, run_all(server.address, batch, 30)):
            assert_exact(qwen2_model, ids, result, 30)   # 30 steps: digests compared
        if "192" in extra:
            with Client(server.address, timeout=60) as c:
                assert c.stats()["retractions"] > 0
    finally:
        server.stop()


def test_seeded_sampling_grammars_and_penalties_equal_one_process(pp2, one_process):
    batch = prompts(3, seed=61)
    cases = [dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16),
             dict(response_format={"type": "regex", "regex": "[a-z ]{4,20}"},
                  max_tokens=24),
             dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                  min_tokens=10, max_tokens=16)]

    def outputs(address):
        with Client(address, timeout=120) as c:
            return [c.generate(input_ids=ids, **case).token_ids
                    for ids in batch for case in cases]
    assert outputs(pp2.address) == outputs(one_process.address)


def test_a_hybrid_model_pipelines_exactly(tmp_path_factory):
    """qwen3_next with 4 layers (recurrent, attention, recurrent, attention): each
    stage holds one of each; prefix hits resume from the stages' state snapshots."""
    spec = dataclasses.replace(hybrid_spec("qwen3_next"), num_layers=4)
    path = str(build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_next4", spec))
    server = Server(path, "--pp", "2", "--kv-capacity", "4096", "--speculative", "off",
                    "--log-level", "warning")
    try:
        batch = prompts(4, seed=41)
        for ids, result in zip(batch, run_all(server.address, batch, 20)):
            assert_exact(path, ids, result, 20)
        with Client(server.address, timeout=120) as c:
            again = c.generate(input_ids=batch[0] + [7, 8], max_tokens=20, logprobs=True)
        assert again.usage["cached_tokens"] > 0
        assert_exact(path, batch[0] + [7, 8], again, 20)
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_stage_restarts_the_group_and_every_request_is_answered(qwen2_model, how):
    lose_a_rank(qwen2_model, how, "--pp", "2")


@pytest.mark.parametrize("model,args,says", [
    ("llama", ["--pp", "2"], "has no pipeline split (`pipeline()`)"),
    ("qwen2", ["--pp", "3"], "its 2 layers cannot give each of 3 stages one"),
    ("qwen2", ["--pp", "2", "--tp", "2"], "--tp and --pp cannot be combined"),
])
def test_models_that_cannot_be_pipelined_are_refused_before_anything_starts(
        llama_model, qwen2_model, model, args, says):
    path = llama_model if model == "llama" else qwen2_model
    stderr = refused_at_start("--model", path, *args)
    assert says in stderr, stderr[-2000:]
    assert "worker" not in stderr.split(says)[0].lower().replace("worker group", "")


def test_stages_holding_different_kinds_of_layers_are_refused(hybrid_model):
    """qwen3_next with 2 layers: one stage would hold the recurrent layer, the other
    the attention one, and run a Step differently; the group refuses to start."""
    stderr = refused_at_start("--model", hybrid_model("qwen3_next"), "--pp", "2")
    assert "the pipeline stages hold different kinds of layers" in stderr, stderr[-2000:]


def test_a_constrained_request_the_worker_cannot_run_is_refused_and_the_group_stays(
        tmp_path_factory):
    """With the model's vocabulary no larger than transformers' qwen2 tokenizer,
    llguidance cannot read it: a constrained request ends with an error saying so,
    before any rank sees it; the group serves on with the same processes."""
    spec = dataclasses.replace(QWEN2, extra=())
    path = str(build_tiny_model(tmp_path_factory.mktemp("models") / "qwen2-513", spec))
    server = Server(path, "--pp", "2", "--kv-capacity", "4096", "--speculative", "off",
                    "--log-level", "warning")
    try:
        before = rank_pids(server)
        ids = prompts(1, seed=71)[0]
        with Client(server.address, timeout=60) as c:
            refused = c.generate(input_ids=ids, max_tokens=8, response_format={
                "type": "regex", "regex": "[a-z]+"})
            assert refused.finish_reason == "error"
            assert "cannot run constrained requests" in refused.error
            assert_exact(path, ids, c.generate(input_ids=ids, max_tokens=MAX_TOKENS,
                                               logprobs=True))
        assert rank_pids(server) == before
    finally:
        server.stop()


def test_stages_on_other_machines_join_through_a_hostfile(qwen2_model, tmp_path):
    """A hostfile group with `mlxd rank --pp 2`: exact. Its remote Step socket takes
    raw bytes (no handshake, 1 MiB, peers that vanish) and a CURVE client with
    another key pushing a Step: nothing reaches the rank, which serves on."""
    with hostfile_group(qwen2_model, tmp_path, "--pp", "2") as (server, rank, steps):
        batch = prompts(4, seed=51)
        for ids, result in zip(batch, run_all(server.address, batch, 20)):
            assert_exact(qwen2_model, ids, result, 20)
        remote = children_of(rank.pid)
        send_raw_garbage(steps)
        push_as_stranger(steps, tmp_path / "server.key")
        with Client(server.address, timeout=60) as c:
            assert c.stats()["worker"]["pipeline_parallel"] == 2
            ids = prompts(1, seed=53)[0]
            assert_exact(qwen2_model, ids, c.generate(input_ids=ids, max_tokens=MAX_TOKENS,
                                                      logprobs=True))
        assert children_of(rank.pid) == remote


def push_as_stranger(address: str, key_file: Path) -> None:
    """A CURVE client holding the server's public key but a key pair of its own
    pushes a Step that would end the rank (a decode of a request it does not run):
    the rank's authenticator admits the server's key only."""
    import time

    import zmq

    from mlxd.protocol import DecodeRow, Step, encode
    from mlxd.runtime.keys import read_secret_key

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = read_secret_key(key_file).public
    sock.connect(address)
    try:
        sock.send(encode(Step(step_id=10**9, decodes=[DecodeRow(12345, 1)])),
                  zmq.NOBLOCK)
    except zmq.Again:   # never admitted: nothing to send to
        pass
    time.sleep(1)
    sock.close()
    ctx.term()
