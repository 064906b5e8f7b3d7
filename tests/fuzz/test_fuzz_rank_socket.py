"""A remote rank's Step socket (`mlxd rank`: Steps over TCP, a CURVE server admitting
only the server's own key pair), fed what the client socket is fed.

The socket itself, in a worker whose Steps come over TCP (the test plays the
scheduler, holding the key): peers without the key are never read (a handshake frame
announced as 1 GiB is refused at its size); an insider holding the key sends garbage,
messages of every tag, frames over the cap (`max_step_bytes`), vanishes mid-frame or
crawls: each is logged and dropped, and the scheduler's Steps run on.

In a group (`--hostfile`, rank 1 under `mlxd rank`): peers without the key leave the
rank serving; an insider's connection is a second authenticated one, which the rank
takes for a new scheduler (design/worker_groups.md): it ends cleanly, saying why, and
the group forms again; a SIGSTOPped remote rank is detected within --worker-timeout
and the group forms again once it wakes.
"""

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from mlxd import Client, MlxdError
from mlxd.protocol import (
    DecodeRow, Decoder, GenerateRequest, PrefillInput, SamplingParams, Step, StepResult, TokenBatch,
    WorkerError, WorkerReady, encode,
)
from mlxd.runtime.keys import KeyPair, read_secret_key
from mlxd.runtime.kv_layout import DECODE_PAGE
from mlxd.protocol.codec import MAX_FRAME_BYTES
from mlxd.runtime.sockets import max_step_bytes
from mlxd.runtime.worker_group import free_ports
from mlxd.scheduler_proc.worker_link import WorkerLink
from mlxd.worker_proc.main import model_max_context
from fuzz_support import Insider, Relay, huge_command, huge_handshake, rss_mib, slow_raw_peers
from proc_support import ProcHarness
from server.group_support import (MAX_TOKENS, assert_exact, hostfile_group, prompts,
                                  rank_pids, run_all)
from support import ROOT, children_of, send_raw_garbage, wait_until
from test_fuzz_sockets import garbage_frames

MAX_RUNNING = 4
FUZZ_SECONDS = 6.0
STEP_TIMEOUT = 60.0


def new_key(path):
    subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(path)], check=True,
                   cwd=ROOT, capture_output=True)
    return path


class TcpWorker(ProcHarness):
    """A worker whose Step socket is TCP under `key` (as a remote rank's), with the
    test as its scheduler: `steps` holds the key, `results` takes its replies."""

    def __init__(self, model: str, tmp_path, key):
        super().__init__("worker", tmp_path, STEP_TIMEOUT)
        self.pair = read_secret_key(key)
        self.address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
        self.results = self._socket(zmq.PULL, bind=self.ipc("out"))
        self.start_child("-m", "mlxd.worker_proc", "--model", model, "--kv-capacity", "4096",
                         "--max-running-requests", str(MAX_RUNNING), "--input-addr",
                         self.address, "--output-addr", self.ipc("out"),
                         "--curve-secret-key", str(key), "--log-level", "info")
        self.steps = Insider(zmq.PUSH, self.address, self.pair, wait=60)
        self.decoder = Decoder(WorkerReady, StepResult, WorkerError)
        assert isinstance(self._recv(self.results, self.decoder, "Ready"), WorkerReady)
        self.step_ids = itertools.count(1)
        self.pages = itertools.count(1)   # a fresh page per request, as the scheduler books

    def lines(self, text: str) -> int:
        """How often its whole log says `text`."""
        return self.child.log_path.read_text(errors="replace").count(text)

    def settle(self, quiet: float = 2.0) -> None:
        """Take every reply until none comes for `quiet` seconds."""
        while self.results.poll(quiet * 1000):
            self.results.recv()

    def serves(self) -> None:
        """A fresh request runs (after a reset: a Step that cannot match drops every
        request a fuzzer left), its prefill and a decode in time."""
        assert self.proc.poll() is None, self.log()
        self.settle()
        self.steps.send(encode(Step(next(self.step_ids), [DecodeRow(-12345, 1)])))
        assert isinstance(self._recv(self.results, self.decoder, "the reset"), WorkerError)
        rid, ids = 7, [5, 6, 7, 8, 9]
        first = next(self.pages) * DECODE_PAGE   # position p at offset p of the page
        prefill = PrefillInput(rid, ids, [], [first + p for p in range(len(ids))],
                               SamplingParams())
        started = time.monotonic()
        for step in (Step(next(self.step_ids), prefills=[prefill]),
                     Step(next(self.step_ids), [DecodeRow(rid, first + len(ids))]),
                     Step(next(self.step_ids), releases=[rid])):
            self.steps.send(encode(step))
            reply = self._recv(self.results, self.decoder, f"step {step.step_id}")
            assert isinstance(reply, StepResult) and reply.step_id == step.step_id, reply
        assert time.monotonic() - started < 10

    def close(self) -> None:
        self.steps.close()
        super().close()


@pytest.fixture(scope="module")
def worker(llama_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tcp-worker")
    with TcpWorker(llama_model, folder, new_key(folder / "server.key")) as w:
        yield w


def test_the_cap_holds_the_largest_step_a_group_sends(llama_model):
    """Every running request prefilling its whole context at once (input, slot and
    window ids), its penalty history as long, every id at msgpack's widest, and
    sampling parameters with a 3.5 MiB grammar: within `max_step_bytes`."""
    context = model_max_context(llama_model)
    wide = [2**40] * context
    sampling = SamplingParams(bias_ids=[2**40] * 300, bias_values=[1.5] * 300,
                              grammar="x" * (7 << 19), think_start_ids=[2**40] * 8)
    prefills = [PrefillInput(2**62 + i, wide, [], wide, sampling, new_window_ids=wide,
                             prompt_tail=wide[:context // 2], output_ids=wide[context // 2:],
                             stop_token_ids=[2**40] * 64) for i in range(MAX_RUNNING)]
    step = Step(2**62, releases=[2**62] * MAX_RUNNING, prefills=prefills)
    assert len(encode(step)) <= max_step_bytes(context, MAX_RUNNING)


def test_peers_without_the_key_are_never_read(worker):
    """A 1 GiB handshake frame is refused at its size, raw bytes and slow greetings
    cost a connection each, a CURVE client with another key is refused: nothing of
    theirs is read, and the scheduler's Steps run meanwhile."""
    taken, grew = huge_handshake(worker.address, worker.proc.pid)
    assert taken < 16 << 20 and grew < 16, (taken, grew)
    send_raw_garbage(worker.address)
    crawlers = threading.Thread(target=slow_raw_peers, args=(worker.address, 20, 4.0))
    crawlers.start()
    worker.serves()
    crawlers.join()
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.PUSH)   # knows the server's public key, holds its own pair
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
    stranger.curve_serverkey = worker.pair.public
    stranger.connect(worker.address)
    try:
        try:
            stranger.send(encode(Step(10**9, [DecodeRow(12345, 1)])), zmq.NOBLOCK)
        except zmq.Again:   # never admitted: nothing to send to
            pass
        assert wait_until(lambda: worker.lines("refused a connection to the Step socket"), 15)
    finally:
        stranger.close()
        ctx.term()
    assert not worker.lines("dropped a malformed frame")
    worker.serves()


def test_an_insider_s_garbage_and_wrong_tags_are_logged_and_dropped(worker):
    insider = Insider(zmq.PUSH, worker.address, worker.pair)
    try:
        deadline = time.monotonic() + FUZZ_SECONDS
        for frame in garbage_frames(random.Random(23)):
            if time.monotonic() > deadline:
                break
            insider.send(frame)
        for msg in (GenerateRequest("x", prompt="hi"), TokenBatch([])):   # other sockets'
            insider.send(encode(msg))
        worker.settle()
    finally:
        insider.close()
    assert worker.lines("dropped a malformed frame from the scheduler")
    assert worker.lines("unexpected message tag")
    worker.serves()


def test_an_insider_s_frame_over_the_cap_is_refused_unbuffered(worker, llama_model):
    """The largest Step the cap takes is read (and refused as malformed: zeros); one
    byte more and ZeroMQ drops the connection at the frame's size."""
    cap = min(max_step_bytes(model_max_context(llama_model), MAX_RUNNING), MAX_FRAME_BYTES)
    insider = Insider(zmq.PUSH, worker.address, worker.pair)
    try:
        dropped = worker.lines("dropped a malformed frame")
        insider.send(bytes(cap))
        assert wait_until(lambda: worker.lines("dropped a malformed frame") > dropped, 15)
        assert not insider.dropped(1)
        before = rss_mib(worker.proc.pid)
        insider.send(bytes(cap + 1))
        assert insider.dropped()
        assert rss_mib(worker.proc.pid) - before < cap / 2**20 / 2
    finally:
        insider.close()
    worker.serves()


def test_an_insider_that_vanishes_or_crawls_holds_up_nothing(worker):
    """Cut off 256 KiB into a 4 MiB frame; then trickling a frame at 32 KiB/s while
    the scheduler's Steps run as fast as ever, and vanishing part way."""
    relay = Relay(worker.address, cut_after=256 << 10)
    insider = Insider(zmq.PUSH, relay.address, worker.pair)
    try:
        insider.send(bytes(4 << 20))
        assert relay.cut.wait(15)
    finally:
        insider.close()
    worker.serves()
    relay = Relay(worker.address, rate=32 << 10)
    insider = Insider(zmq.PUSH, relay.address, worker.pair)
    try:
        insider.send(random.Random(5).randbytes(1 << 20))
        time.sleep(1)
        worker.serves()
        assert relay.passed < 1 << 20   # served while its frame was still arriving
    finally:
        relay.close()
        insider.close()
    worker.serves()


def test_the_scheduler_s_link_buffers_nothing_from_whoever_holds_a_rank_s_port(tmp_path):
    """Whoever answers at a remote rank's address without the key (its machine's port
    while no rank listens there): a 1 GiB handshake command is refused at its size."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    ctx = zmq.Context()
    link = WorkerLink(ctx, f"ipc://{tmp_path}/w", ranks=2, curve=KeyPair.new(),
                      remote=[f"tcp://127.0.0.1:{listener.getsockname()[1]}"])
    try:
        raw, _ = listener.accept()
        with raw:
            assert huge_command(raw, as_server=True) < 16 << 20
    finally:
        link.close()
        listener.close()
        ctx.term()


# ---- a group with a rank under `mlxd rank` -------------------------------------------

@pytest.fixture(scope="module")
def group(llama_model, tmp_path_factory):
    """(server, `mlxd rank` process, rank 1's Step address, the rank's stderr lines):
    restarts enough for every test's."""
    folder = tmp_path_factory.mktemp("group")
    with hostfile_group(llama_model, folder, "--worker-restarts", "10") as (server, rank,
                                                                             steps):
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(rank.stderr), daemon=True).start()
        yield server, rank, steps, lines, read_secret_key(folder / "server.key")


def remote_worker(rank: subprocess.Popen) -> int:
    kids = children_of(rank.pid)
    assert len(kids) == 1, kids
    return kids[0]


def serves_exactly(server, model: str, seed: int, within: float = 90) -> None:
    """The group (formed again, if it was broken) serves a greedy request exactly."""
    ids = prompts(1, seed=seed)[0]

    def served() -> bool:
        try:
            with Client(server.address, timeout=30) as c:
                return c.generate(input_ids=ids, max_tokens=2).finish_reason == "length"
        except MlxdError:
            return False
    assert wait_until(served, within, 1.0)
    with Client(server.address, timeout=60) as c:
        assert_exact(model, ids, c.generate(input_ids=ids, max_tokens=MAX_TOKENS,
                                            logprobs=True))


def test_a_remote_rank_s_peers_without_the_key_leave_it_serving(group, llama_model):
    server, rank, steps, _, _ = group
    serves_exactly(server, llama_model, seed=81)
    pid = remote_worker(rank)
    taken, grew = huge_handshake(steps, pid)
    assert taken < 16 << 20 and grew < 16, (taken, grew)
    crawlers = threading.Thread(target=slow_raw_peers, args=(steps, 10, 3.0))
    crawlers.start()
    serves_exactly(server, llama_model, seed=82, within=15)
    crawlers.join()
    assert remote_worker(rank) == pid


def test_an_insider_at_a_remote_rank_ends_it_cleanly_and_the_group_forms_again(group,
                                                                              llama_model):
    """An insider's connection is the rank's second authenticated one, as a new
    scheduler's would be: the rank exits saying why (whatever the insider sends: garbage,
    a frame over the cap, then vanishing), `mlxd rank` starts another, and the group
    forms again and serves exactly."""
    server, rank, steps, lines, pair = group
    serves_exactly(server, llama_model, seed=83)
    pid, seen = remote_worker(rank), len(lines)
    insider = Insider(zmq.PUSH, steps, pair)
    try:
        for frame in (b"garbage", encode(GenerateRequest("x", prompt="hi")), bytes(80 << 20)):
            try:
                insider.sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:   # the rank has gone already
                break
    finally:
        insider.close()
    assert wait_until(lambda: pid not in children_of(rank.pid), 15)
    assert wait_until(lambda: "the worker exited with code 3" in "".join(lines[seen:]), 10)
    assert "the scheduler's connection ended or was made anew" in "".join(lines[seen:])
    assert rank.poll() is None
    serves_exactly(server, llama_model, seed=84)


def test_a_stopped_remote_rank_is_detected_within_the_worker_timeout(group, llama_model):
    """SIGSTOP of the remote rank under load (--worker-timeout 5): the scheduler sees
    it within the deadline (its link's heartbeats go unanswered) and restarts the group
    (rank 0 replaced), whose running requests wait to resume; once the rank wakes it
    ends (it sees a new scheduler, or is past its own deadline), `mlxd rank` starts
    another, the group forms and every request is answered."""
    server, rank, _, lines, _ = group
    serves_exactly(server, llama_model, seed=85)
    pid, first = remote_worker(rank), rank_pids(server)[0]
    seen, rank_seen = len(server.stderr_lines), len(lines)
    results = []
    runner = threading.Thread(target=lambda: results.extend(
        run_all(server.address, prompts(4, seed=86), 300, ignore_eos=True)))
    runner.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert wait_until(lambda: any("the worker's socket closed" in line or
                                      "did not answer step" in line
                                      for line in server.stderr_lines[seen:]), 5 + 1)
        assert time.monotonic() - stopped < 5 + 1
        assert wait_until(lambda: rank_pids(server).get(0) not in (None, first), 15)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: pid not in children_of(rank.pid), 30)
    assert wait_until(lambda: "the worker exited with code" in "".join(lines[rank_seen:]), 10)
    said = "".join(lines[rank_seen:])   # a new scheduler, or its collective's peer gone
    assert "this rank exits" in said or "the worker group broke" in said, said[-2000:]
    runner.join(60)
    assert len(results) == 4 and all(getattr(r, "finish_reason", None) in ("length", "error")
                                      for r in results), results
    serves_exactly(server, llama_model, seed=87)
