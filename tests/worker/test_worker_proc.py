"""worker_proc as a real process with a tiny llama; the test plays the scheduler.

Sockets seen from the test (the worker binds what it receives on):
  results  PULL bound at output_addr   WorkerReady, then StepResult / WorkerError
  steps    PUSH -> input_addr          hand-written Steps
"""

import itertools
import json
from pathlib import Path

import mlx.core as mx
import msgpack
import pytest
import zmq

from mlxd.protocol import (
    DecodeRow, Decoder, PrefillInput, Ready, SamplingParams, Step, StepResult, WorkerError,
    WorkerReady, encode,
)
from mlxd.runtime.kv_layout import DECODE_PAGE
from proc_support import ProcHarness
from support import (
    PROMPTS, PageBooker, decode_rows, encode as encode_prompt, load_reference, reference_tokens,
)

KV_CAPACITY = 4096
READY_TIMEOUT = 60.0
RECV_TIMEOUT = 30.0
QUIET = 0.3
N = 10                    # tokens generated per request in the reference comparisons
GREEDY = SamplingParams()


# ---- the worker process ------------------------------------------------------

class WorkerProc(ProcHarness):
    """`python -m worker_proc` plus the two sockets the scheduler would hold."""

    def __init__(self, model_path: str, tmp_path: Path, *extra: str):
        super().__init__("worker", tmp_path, RECV_TIMEOUT)
        self.model_path = model_path
        self.extra = extra
        self.start()

    def start(self) -> None:
        self.close_sockets()
        for name in ("in", "out"):
            Path(self.dir, name).unlink(missing_ok=True)
        self.results = self._socket(zmq.PULL, bind=self.ipc("out"))
        self.steps = self._socket(zmq.PUSH, connect=self.ipc("in"))
        self.start_child("-m", "mlxd.worker_proc", "--model", self.model_path,
                         "--kv-capacity", str(KV_CAPACITY), "--input-addr", self.ipc("in"),
                         "--output-addr", self.ipc("out"), *self.extra)
        msg = self.recv(READY_TIMEOUT, "Ready")
        assert isinstance(msg, WorkerReady), msg
        self.limits = msg.limits
        # slot ids are never reused within a process; from page 1 (page 0 is padding),
        # so one request's run of them sits in its pages as the scheduler's would
        self.slots = itertools.count(DECODE_PAGE)
        self.step_ids = itertools.count(1)

    def recv(self, timeout: float = RECV_TIMEOUT, what: str = "reply"):
        return self._recv(self.results, Decoder(WorkerReady, StepResult, WorkerError), what,
                          timeout)

    def assert_quiet(self, seconds: float = QUIET) -> None:
        if self.results.poll(seconds * 1000):
            self.fail(f"unexpected reply {self.recv()}")

    def new_slots(self, n: int) -> list[int]:
        slots = [next(self.slots) for _ in range(n)]
        assert not slots or slots[-1] <= KV_CAPACITY, "the test ran out of slots"
        return slots

    def send(self, step: Step):
        """Send one Step; return its StepResult or WorkerError."""
        self.steps.send(encode(step))
        reply = self.recv(what=f"reply to step {step.step_id}")
        assert reply.step_id == step.step_id, (reply, step.step_id)
        return reply

    def reset(self) -> None:
        """Forget every request: a Step that cannot match makes the worker drop all state."""
        if self.proc.poll() is not None:
            return
        while self.results.poll(50):
            self.results.recv()
        step_id = next(self.step_ids)
        self.steps.send(encode(Step(step_id, [DecodeRow(-12345, 1)])))
        while True:
            reply = self.recv(what="the reset reply")
            if reply.step_id == step_id:
                return


class Driver:
    """Plays the scheduler for one test: books slots, tracks running rids, collects
    each rid's (token, logprob, top_logprobs)."""

    def __init__(self, w: WorkerProc):
        self.w = w
        self.running: list[int] = []
        self.slot_ids: dict[int, list[int]] = {}
        self.decode_slots: dict[int, list[int]] = {}
        self.out: dict[int, list[tuple]] = {}
        # slots as the scheduler books them: in the worker's pages (allocator.py)
        self.book = PageBooker(KV_CAPACITY, w.limits.decode_page or 1)

    def prefill(self, rid: int, ids: list[int], prefix_slots=(), sampling=GREEDY,
                needs_logits: bool = True) -> PrefillInput:
        slots = self.book.slots(rid, len(ids), len(prefix_slots))
        self.slot_ids.setdefault(rid, []).extend(slots)
        return PrefillInput(rid, list(ids), list(prefix_slots), slots, sampling, needs_logits)

    def step(self, prefills=(), releases=()) -> StepResult:
        self.running = [r for r in self.running if r not in releases]
        decode_slots = [self.book.slots(rid, 1)[0] for rid in self.running]
        for rid, slot in zip(self.running, decode_slots):
            self.decode_slots.setdefault(rid, []).append(slot)
        step = Step(next(self.w.step_ids), decode_rows(
            self.running, decode_slots,
            chain_pages=[self.book.book_next(rid) for rid in self.running]),
            list(prefills), list(releases))
        result = self.w.send(step)
        if not isinstance(result, StepResult):
            self.w.fail(f"step {step} failed: {result}")
        expected = self.running + [p.rid for p in prefills if p.needs_logits]
        assert sorted(result.rids) == sorted(expected), (result.rids, expected)
        tops = result.top_logprobs or [None] * len(result.rids)
        for rid, tok, lp, top in zip(result.rids, result.tokens, result.logprobs, tops):
            self.out.setdefault(rid, []).append((tok, lp, top))
        self.running += [p.rid for p in prefills if p.needs_logits]
        return result

    def run_until(self, n: int, rids) -> None:
        """Decode until every rid in `rids` has `n` tokens, releasing each when done."""
        rids = set(rids)
        while True:
            done = [r for r in self.running if len(self.out.get(r, [])) >= n and r in rids]
            if len(done) == len([r for r in self.running if r in rids]):
                if done:
                    self.step(releases=done)
                return
            self.step(releases=done)

    def tokens(self, rid: int) -> list[int]:
        return [t for t, _, _ in self.out[rid]]


@pytest.fixture(scope="module")
def worker_proc(llama_model, tmp_path_factory):
    with WorkerProc(llama_model, tmp_path_factory.mktemp("worker")) as w:
        yield w


@pytest.fixture
def worker(worker_proc):
    worker_proc.ensure_alive()
    try:
        yield worker_proc
    finally:
        worker_proc.reset()


@pytest.fixture
def driver(worker):
    return Driver(worker)


def prompt_ids(model_path: str, i: int) -> list[int]:
    return encode_prompt(model_path, PROMPTS[i])


def assert_matches_reference(model_path: str, input_ids: list[int], got: list[tuple],
                             n: int = N) -> None:
    ref = reference_tokens(model_path, input_ids, n)
    assert len(got) >= len(ref)
    got = got[:len(ref)]
    assert [t for t, *_ in got] == [t for t, _ in ref], "greedy tokens differ from mlx_lm"
    worst = max(abs(a[1] - b[1]) for a, b in zip(got, ref))
    assert worst < 1e-3, f"logprobs differ from mlx_lm by {worst}"


# ---- tests -----------------------------------------------------------------------

def test_ready_limits(worker, llama_model):
    limits = worker.limits
    assert limits.kv_capacity == KV_CAPACITY
    config = json.loads(Path(llama_model, "config.json").read_text())
    assert limits.max_context == config["max_position_embeddings"]
    assert isinstance(limits.blas, str) and limits.blas
    assert isinstance(limits.device, str)
    assert limits.bytes_per_token > 0
    # one KV store: the pool (page 0 is padding), and no decode cache beside it
    assert limits.decode_page == DECODE_PAGE
    assert limits.kv_pool_bytes == (KV_CAPACITY + DECODE_PAGE) * limits.bytes_per_token
    assert limits.vocab_size == config["vocab_size"]
    assert limits.decode_cache_tokens == 0
    assert limits.overlap is True


def test_staggered_requests_match_mlx_lm(driver, llama_model):
    a, b, c = (prompt_ids(llama_model, i) for i in (0, 1, 3))
    driver.step(prefills=[driver.prefill(1, a)])
    driver.step(prefills=[driver.prefill(2, b)])         # joins while 1 decodes
    driver.step()
    driver.step(prefills=[driver.prefill(3, c)])         # joins a batch of two
    driver.run_until(N, {1, 2, 3})
    assert driver.running == []
    for rid, ids in ((1, a), (2, b), (3, c)):
        assert_matches_reference(llama_model, ids, driver.out[rid])


def test_two_prefills_in_one_step_match_mlx_lm(driver, llama_model):
    a, b = prompt_ids(llama_model, 5), prompt_ids(llama_model, 7)
    driver.step(prefills=[driver.prefill(1, a), driver.prefill(2, b)])
    driver.run_until(N, {1, 2})
    assert_matches_reference(llama_model, a, driver.out[1])
    assert_matches_reference(llama_model, b, driver.out[2])


def test_prefix_slots_match_reference_for_the_full_prompt(driver, llama_model):
    x = prompt_ids(llama_model, 3)
    long, short = prompt_ids(llama_model, 6), prompt_ids(llama_model, 4)
    # request 1 decodes while longer and shorter requests join and leave its batch
    driver.step(prefills=[driver.prefill(1, x)])
    driver.step(prefills=[driver.prefill(9, long)])
    driver.step(prefills=[driver.prefill(8, short)])
    driver.step()
    driver.step(releases=[9])
    driver.step(releases=[1, 8])
    t = driver.tokens(1)                   # t[0..4]; KV of t[0..3] sits in decode slots
    prompt_slots, decode_slots = driver.slot_ids[1], driver.decode_slots[1]
    assert len(t) == 5 and len(decode_slots) == 4
    assert_matches_reference(llama_model, x, driver.out[1], n=5)
    assert_matches_reference(llama_model, long, driver.out[9], n=len(driver.out[9]))

    # 2: half of 1's prompt from the pool, then a different continuation
    k = len(x) // 2
    tail = long[1:]                        # without BOS
    driver.step(prefills=[driver.prefill(2, tail, prefix_slots=prompt_slots[:k])])
    # 3: 1's whole prompt and its decoded tokens from the pool, the newest token fresh
    driver.step(prefills=[driver.prefill(3, [t[4]], prefix_slots=prompt_slots + decode_slots)])
    driver.run_until(N, {2, 3})
    assert_matches_reference(llama_model, x[:k] + tail, driver.out[2])
    assert_matches_reference(llama_model, x + t, driver.out[3])


def test_chunked_prefill_without_logits_then_prefix(driver, llama_model):
    z = prompt_ids(llama_model, 6)
    m = len(z) - 3
    result = driver.step(prefills=[driver.prefill(1, z[:m], needs_logits=False)])
    assert result.rids == [] and driver.running == []
    driver.step(prefills=[driver.prefill(2, z[m:], prefix_slots=driver.slot_ids[1])])
    driver.run_until(N, {2})
    assert_matches_reference(llama_model, z, driver.out[2])


SEEDED = {
    "temperature 1": SamplingParams(temperature=1.0, seed=7),
    "filtered": SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=11),
}


@pytest.mark.parametrize("case", list(SEEDED))
def test_seeded_sampling_is_the_same_alone_or_batched(driver, llama_model, case):
    p = prompt_ids(llama_model, 2)
    seeded = SEEDED[case]
    driver.step(prefills=[driver.prefill(1, p, sampling=seeded)])
    driver.run_until(N, {1})
    alone = driver.tokens(1)

    driver.step(prefills=[driver.prefill(2, prompt_ids(llama_model, 0))])
    driver.step(prefills=[driver.prefill(
        3, prompt_ids(llama_model, 1), sampling=SamplingParams(temperature=1.0, seed=3))])
    driver.step(prefills=[driver.prefill(4, p, sampling=seeded)])   # joins as third row
    driver.step(prefills=[
        driver.prefill(5, prompt_ids(llama_model, 4),
                       sampling=SamplingParams(temperature=0.8, top_k=20)),
        driver.prefill(6, prompt_ids(llama_model, 5),
                       sampling=SamplingParams(temperature=1.2, top_p=0.5, min_p=0.2))])
    driver.step(releases=[2])
    driver.run_until(N, {3, 4, 5, 6})
    assert driver.tokens(4)[:N] == alone[:N]
    greedy = [t for t, _ in reference_tokens(llama_model, p, N)]
    assert alone[:len(greedy)] != greedy, "sampling picked exactly the greedy tokens"


def test_top_logprobs_sorted_of_the_asked_length(driver, llama_model):
    a = prompt_ids(llama_model, 0)
    driver.step(prefills=[
        driver.prefill(1, a, sampling=SamplingParams(top_logprobs=5)),
        driver.prefill(2, prompt_ids(llama_model, 1)),
        driver.prefill(3, prompt_ids(llama_model, 3),
                       sampling=SamplingParams(temperature=1.0, seed=1, top_logprobs=3)),
    ])
    for _ in range(3):
        driver.step()
    for rid, n in ((1, 5), (3, 3)):
        for token, lp, top in driver.out[rid]:
            ids, lps = top
            assert len(ids) == n and len(lps) == n and len(set(ids)) == n
            assert lps == sorted(lps, reverse=True)
            assert all(x <= 1e-6 for x in lps)
            if token in ids:
                assert abs(lps[ids.index(token)] - lp) < 1e-5
            if rid == 1:            # greedy: the chosen token is the most likely one
                assert ids[0] == token and abs(lps[0] - lp) < 1e-5
            else:
                assert lps[0] >= lp - 1e-6
    assert all(top is None for _, _, top in driver.out[2])

    # the first step's list is the model's own top 5
    model, _ = load_reference(llama_model)
    logits = model(mx.array(a)[None])[0, -1].astype(mx.float32)
    logprobs = (logits - mx.logsumexp(logits)).tolist()
    ref_ids = sorted(range(len(logprobs)), key=lambda i: -logprobs[i])[:5]
    ids, lps = driver.out[1][0][2]
    assert ids == ref_ids
    assert max(abs(x - logprobs[i]) for x, i in zip(lps, ids)) < 1e-3


def serve_fresh_request(w: WorkerProc, model_path: str, rid: int = 900) -> None:
    """The worker still serves: a new request matches mlx_lm."""
    d = Driver(w)
    ids = prompt_ids(model_path, 5)
    d.step(prefills=[d.prefill(rid, ids)])
    d.run_until(6, {rid})
    assert_matches_reference(model_path, ids, d.out[rid], n=6)


def _two_running(d: Driver, model_path: str) -> None:
    d.step(prefills=[d.prefill(1, prompt_ids(model_path, 0))])
    d.step(prefills=[d.prefill(2, prompt_ids(model_path, 1))])


BAD_DECODES = {
    "unknown rid": lambda d: ([1, 2, 77], d.w.new_slots(3)),
    "running rid missing": lambda d: ([1], d.w.new_slots(1)),
    "rid twice": lambda d: ([1, 2, 2], d.w.new_slots(3)),
    "nothing decoded": lambda d: ([], []),
}


@pytest.mark.parametrize("case", list(BAD_DECODES))
def test_mismatched_decode_rids_get_worker_error(driver, llama_model, case):
    _two_running(driver, llama_model)
    rids, slots = BAD_DECODES[case](driver)
    step = Step(next(driver.w.step_ids), decode_rows(rids, slots))
    reply = driver.w.send(step)
    assert isinstance(reply, WorkerError), reply
    assert reply.message
    # the worker dropped every request: decoding the old ones fails too
    reply = driver.w.send(Step(next(driver.w.step_ids), decode_rows([1, 2], driver.w.new_slots(2))))
    assert isinstance(reply, WorkerError), reply
    serve_fresh_request(driver.w, llama_model)


@pytest.mark.parametrize("case", ["already running", "twice in one step"])
def test_prefill_of_a_running_rid_gets_worker_error(driver, llama_model, case):
    """A rid names one request: a second prefill for a running rid must be refused,
    or the batch holds two rows for it and both write KV to the one slot sent for it."""
    if case == "already running":
        driver.step(prefills=[driver.prefill(1, prompt_ids(llama_model, 0))])
        step = Step(next(driver.w.step_ids), decode_rows([1], driver.w.new_slots(1)),
                    [driver.prefill(1, prompt_ids(llama_model, 1))])
    else:
        step = Step(next(driver.w.step_ids), prefills=[
            driver.prefill(1, prompt_ids(llama_model, 0)),
            driver.prefill(1, prompt_ids(llama_model, 1))])
    reply = driver.w.send(step)
    assert isinstance(reply, WorkerError), (
        f"the worker accepted a second prefill for running rid 1: {reply}")
    serve_fresh_request(driver.w, llama_model)


def test_decode_with_nothing_running_gets_worker_error(worker, llama_model):
    reply = worker.send(Step(next(worker.step_ids), decode_rows([5], worker.new_slots(1))))
    assert isinstance(reply, WorkerError), reply
    serve_fresh_request(worker, llama_model)


BAD_SLOTS = {
    "new slot 0": lambda w, ids: dict(new=[0] + w.new_slots(len(ids) - 1)),
    "new slot above capacity": lambda w, ids: dict(new=w.new_slots(len(ids) - 1)
                                                   + [KV_CAPACITY + DECODE_PAGE]),
    "new slot negative": lambda w, ids: dict(new=[-1] + w.new_slots(len(ids) - 1)),
    "prefix slot above capacity": lambda w, ids: dict(prefix=[1, 2, 10**6]),
    "prefix slot 0": lambda w, ids: dict(prefix=[0]),
    "decode slot 0": lambda w, ids: dict(decode=[0]),
    "decode slot above capacity": lambda w, ids: dict(decode=[KV_CAPACITY + DECODE_PAGE]),
}


@pytest.mark.parametrize("case", list(BAD_SLOTS))
def test_out_of_range_slot_ids_get_worker_error(driver, llama_model, case):
    ids = prompt_ids(llama_model, 2)
    driver.step(prefills=[driver.prefill(1, prompt_ids(llama_model, 0))])
    bad = BAD_SLOTS[case](driver.w, ids)
    if "decode" in bad:
        step = Step(next(driver.w.step_ids), decode_rows([1], bad["decode"]))
    else:
        prefill = PrefillInput(2, ids, bad.get("prefix", []),
                               bad.get("new") or driver.w.new_slots(len(ids)), GREEDY)
        step = Step(next(driver.w.step_ids), decode_rows([1], driver.w.new_slots(1)), [prefill])
    reply = driver.w.send(step)
    assert isinstance(reply, WorkerError), reply
    assert driver.w.proc.poll() is None
    serve_fresh_request(driver.w, llama_model)


@pytest.mark.parametrize("token", [512 + 88, 10**6, -1], ids=["vocab+88", "1e6", "-1"])
def test_out_of_vocab_token_ids_get_worker_error(worker, llama_model, token):
    vocab = json.loads(Path(llama_model, "config.json").read_text())["vocab_size"]
    assert vocab == 512
    prefill = PrefillInput(1, [1, 40, token], [], worker.new_slots(3), GREEDY)
    worker.steps.send(encode(Step(next(worker.step_ids), prefills=[prefill])))
    reply = worker.recv(what=f"a reply to a prefill with token id {token}")
    assert isinstance(reply, WorkerError), (
        f"token id {token} outside the vocabulary of {vocab} was run: {reply}")
    assert worker.proc.poll() is None
    serve_fresh_request(worker, llama_model)


SP = [0.0, 1.0, 0, 0.0, None, 0]

GARBAGE = [
    b"",
    b"\xc1",
    b"\x00garbage\xff",
    msgpack.packb({"step_id": 1}),
    msgpack.packb([]),
    msgpack.packb([999, 1]),
    msgpack.packb([51]),
    msgpack.packb([51, 1, [], [], []]),
    msgpack.packb([51, "1", [], [], [], []]),
    msgpack.packb([51, 1, [1], [], [], []]),                   # rids and slots differ
    msgpack.packb([51, 1, ["a"], [1], [], []]),
    msgpack.packb([51, 1, [], [], [], ["x"]]),
    msgpack.packb([51, 1, [], [], {"rid": 1}, []]),
    msgpack.packb([51, 1, [], [], [[1, [5], [], [], SP, True]], []]),   # no new slots
    msgpack.packb([51, 1, [], [], [[1, [], [], [], SP, True]], []]),    # empty prompt
    msgpack.packb([51, 1, [], [], [[1, [5], [], [7], SP]], []]),
    msgpack.packb([51, 1, [], [], [[1, [5], [], [7], SP, 1]], []]),
    msgpack.packb([51, 1, [], [], [[1, [5.0], [], [7], SP, True]], []]),
    msgpack.packb([51, 1, [], [], [[1, [5], [], [7], [-1.0, 1.0, 0, 0.0, None, 0], True]],
                   []]),
    msgpack.packb([51, 1, [], [], [[1, [5], [], [7], [0.0, 1.0, 0, 0.0, None, -2], True]],
                   []]),
    encode(Ready("scheduler")),
    encode(StepResult(1, [], [], [])),
    encode(WorkerError(1, "not for you")),
]


def test_garbage_frames_are_dropped_and_worker_keeps_serving(worker, llama_model):
    for frame in GARBAGE:
        worker.steps.send(frame)
    worker.assert_quiet()
    assert worker.proc.poll() is None, worker.log()
    serve_fresh_request(worker, llama_model)


def test_sigterm_exits_within_5s(llama_model, tmp_path):
    with WorkerProc(llama_model, tmp_path) as w:
        code = w.child.sigterm(5)
        assert code == 0, w.log()


@pytest.mark.parametrize("extra, window_capacity", [((), 2 * (4 * 8 + 64)),
                                                    (("--window-capacity", "50"), 50)],
                         ids=["rule", "flag"])
def test_a_sliding_window_model_gets_a_window_pool(hybrid_model, tmp_path, extra,
                                                   window_capacity):
    """READY reports the window pool (the rule's size for 4 requests, 8-token windows
    and 64 prefill tokens, or the flag's) and counts it in kv_pool_bytes; prefills
    must name a window id per new token."""
    path = hybrid_model("gemma3_text")
    with WorkerProc(path, tmp_path, "--max-running-requests", "4", "--max-prefill-tokens",
                    "64", "--decode-layout", "padded", *extra) as w:
        limits = w.limits
        assert limits.window_capacity == window_capacity and limits.window_sizes == [8]
        layer = limits.bytes_per_token // 2   # one global layer, one windowed layer
        assert limits.kv_pool_bytes == (KV_CAPACITY + 1 + window_capacity + 1) * layer
        ids = encode_prompt(path, PROMPTS[1])
        prefill = PrefillInput(1, ids, [], w.new_slots(len(ids)), GREEDY)
        assert isinstance(w.send(Step(next(w.step_ids), prefills=[prefill])), WorkerError)
        held = min(8, len(ids))
        prefill.new_window_ids = [0] * (len(ids) - held) + list(range(1, held + 1))
        reply = w.send(Step(next(w.step_ids), prefills=[prefill]))
        assert isinstance(reply, StepResult), reply
        assert reply.tokens == [reference_tokens(path, ids, 1)[0][0]]
