"""scheduler_proc as a real process; the test plays the worker, the tokenizer and the launcher.

Sockets seen from the test (the scheduler binds what it receives on):
  steps     PULL bound at worker_input_addr    Step from the scheduler
  results   PUSH -> worker_output_addr         WorkerReady, StepResult, WorkerError
  batches   ROUTER bound at frontend_addr      SchedulerReady, then TokenBatch (those
                                               carrying only cache events set aside)
  requests  the same socket                    TokenizedRequest, Abort
  launcher  PULL bound at ready_addr           Ready("scheduler")
"""

import os
import re
import signal
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from mlxd.protocol import (
    Abort, DecodeRow, Decoder, GetStats, Ready, SamplingParams, SchedulerReady, Stats, Step, StepResult,
    StepTiming, TokenBatch, TokenEntry, TokenizedRequest, Usage, WorkerError, WorkerLimits,
    WorkerReady, encode,
)
from proc_support import ProcHarness, RouterEnd
import support
from support import pid_alive, wait_until

RECV_TIMEOUT = 20.0      # a missing message fails the test after this long
QUIET = 0.3              # how long "nothing else arrives" is watched
KV_CAPACITY = 256
MAX_CONTEXT = 128
GREEDY = SamplingParams()


# ---- helpers ----------------------------------------------------------------

def worker_limits(kv_capacity=KV_CAPACITY, max_context=MAX_CONTEXT) -> WorkerLimits:
    return support.worker_limits(kv_capacity, max_context)


class Harness(ProcHarness):
    """Starts `python -m scheduler_proc` and plays every peer over real sockets."""

    def __init__(self, tmp_path: Path):
        super().__init__("scheduler", tmp_path, RECV_TIMEOUT)
        self.addr = {name: self.ipc(name) for name in
                     ("frontend", "worker_in", "worker_out", "ready")}
        self.steps = self._socket(zmq.PULL, bind=self.addr["worker_in"])
        self.batches = self.requests = RouterEnd(self.ctx, self.addr["frontend"])
        self.sockets.append(self.batches)
        self.launcher = self._socket(zmq.PULL, bind=self.addr["ready"])
        self.results = self._socket(zmq.PUSH, connect=self.addr["worker_out"])
        self.step_decoder = Decoder(Step)
        self.batch_decoder = Decoder(TokenBatch, SchedulerReady)

    def argv(self, *extra: str) -> list[str]:
        return ["-m", "mlxd.scheduler_proc", "--frontend-addr", self.addr["frontend"],
                "--worker-input-addr", self.addr["worker_in"],
                "--worker-output-addr", self.addr["worker_out"],
                "--ready-addr", self.addr["ready"], "--log-level", "debug", *extra]

    def spawn(self, *extra: str) -> None:
        self.start_child(*self.argv(*extra))

    def worker_ready(self, kv_capacity=KV_CAPACITY, max_context=MAX_CONTEXT) -> SchedulerReady:
        """Send the worker's Ready; return the scheduler's Ready to the tokenizer."""
        self.kv_capacity = kv_capacity
        self.results.send(encode(WorkerReady(worker_limits(kv_capacity, max_context))))
        ready = self._recv(self.batches, self.batch_decoder, "Ready on the tokenizer socket")
        assert isinstance(ready, SchedulerReady)
        return ready

    def worker_dies(self) -> None:
        """The worker's process ends: its bound Step socket goes away."""
        self.sockets.remove(self.steps)
        self.steps.close(linger=0)

    def wait_for_log(self, text: str, timeout: float = RECV_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.child.log():
            if time.monotonic() > deadline:
                self.child.fail(f"no log line {text!r} within {timeout} s")
            time.sleep(0.05)

    def worker_restarts(self) -> None:
        """A new worker binds the Step socket again (before its WorkerReady)."""
        self.steps = self._socket(zmq.PULL, bind=self.addr["worker_in"])

    # ---- receiving with deadlines ------------------------------------------

    def step(self) -> Step:
        return self._recv(self.steps, self.step_decoder, "Step")

    def batch(self) -> TokenBatch:
        msg = self._recv(self.batches, self.batch_decoder, "TokenBatch")
        assert isinstance(msg, TokenBatch), msg
        return msg

    def assert_no_step(self, seconds: float = QUIET) -> None:
        if self.steps.poll(seconds * 1000):
            self.fail(f"unexpected Step {self.step_decoder.decode(self.steps.recv())}")

    def assert_no_batch(self, seconds: float = QUIET) -> None:
        if self.batches.poll(seconds * 1000):
            self.fail(f"unexpected {self.batch_decoder.decode(self.batches.recv())}")

    # ---- playing the peers -------------------------------------------------

    def request(self, rid: int, input_ids: list[int], max_new_tokens: int,
                stop_token_ids=(), sampling: SamplingParams = GREEDY) -> None:
        self.requests.send(encode(TokenizedRequest(rid, list(input_ids), sampling,
                                                   max_new_tokens, list(stop_token_ids))))

    def answer(self, step: Step, tokens: dict[int, int], top_logprobs=None) -> None:
        rids = list(tokens)
        self.results.send(encode(StepResult(
            step.step_id, rids, [tokens[r] for r in rids], [logprob(r, tokens[r]) for r in rids],
            top_logprobs, StepTiming(compute_ms=1.0))))

    def serve(self, scripts: dict[int, list[int]], max_steps: int = 50) -> dict:
        """Answer Steps with each rid's scripted tokens until every rid finished.
        Checks that exactly one TokenBatch follows each step, carrying every rid the
        step produced a token for. Returns {"steps", "entries"(per rid), "batches"}."""
        pos = {rid: 0 for rid in scripts}
        entries: dict[int, list[TokenEntry]] = {rid: [] for rid in scripts}
        steps, batches = [], []
        finished: set[int] = set()
        for _ in range(max_steps):
            if finished >= set(scripts):
                break
            step = self.step()
            steps.append(step)
            rids = [r for r in step.decode_rids + [p.rid for p in step.prefills]
                    if r in scripts]
            tokens = {}
            for rid in rids:
                tokens[rid] = scripts[rid][pos[rid]]
                pos[rid] += 1
            self.answer(step, tokens)
            if not tokens:
                continue
            batch = self.batch()
            batches.append(batch)
            got = [e.rid for e in batch.entries]
            assert sorted(got) == sorted(rids), (
                f"step {step.step_id} produced tokens for {rids}, its TokenBatch has {got}")
            for e in batch.entries:
                assert e.token_ids == [tokens[e.rid]]
                assert e.logprobs == [logprob(e.rid, tokens[e.rid])]
                entries[e.rid].append(e)
                if e.finish_reason:
                    finished.add(e.rid)
        else:
            self.fail(f"requests {set(scripts) - finished} did not finish in {max_steps} steps")
        return {"steps": steps, "entries": entries, "batches": batches}

    def finish_releases(self, rids: set[int]) -> list[Step]:
        """After requests finished: the next Step(s) release them; nothing follows."""
        released, steps = set(), []
        while released < rids:
            step = self.step()
            steps.append(step)
            assert not step.prefills and not step.decode_rids, step
            released |= set(step.releases)
            self.answer(step, {})
        assert released == rids
        self.assert_no_step()
        return steps


def logprob(rid: int, token: int) -> float:
    return -0.001 * (rid * 1000 + token % 1000) - 0.5


@pytest.fixture
def harness(tmp_path):
    with Harness(tmp_path) as h:
        yield h


@pytest.fixture
def sched(harness):
    """A running scheduler that has seen the worker's Ready."""
    harness.spawn()
    harness.worker_ready()
    return harness


def check_step_slots(h: Harness, steps: list[Step]) -> None:
    """Prefill and decode slots are never handed out twice while a request holds them
    (a request's slots are free again once a Step releases it)."""
    held: set[int] = set()
    by_rid: dict[int, list[int]] = {}
    for s in steps:
        for rid in s.releases:
            held -= set(by_rid.pop(rid, []))
        for p in s.prefills:
            check_slots(h, p.new_slot_ids, held)
            by_rid.setdefault(p.rid, []).extend(p.new_slot_ids)
        check_slots(h, [row.slot for row in s.decodes], held)
        for row in s.decodes:
            by_rid.setdefault(row.rid, []).append(row.slot)


def check_slots(h: Harness, slots: list[int], used: set[int]) -> None:
    """Fresh, distinct, in range; adds them to `used`."""
    assert len(set(slots)) == len(slots), slots
    assert all(1 <= s <= h.kv_capacity for s in slots), slots
    assert not used & set(slots), f"slots {sorted(used & set(slots))} handed out twice"
    used |= set(slots)


# ---- the Ready chain ----------------------------------------------------------

def test_ready_chain(harness):
    harness.spawn("--max-running-requests", "7")
    # Nothing is announced before the worker is ready.
    assert not harness.batches.poll(300) and not harness.launcher.poll(0)
    ready = harness.worker_ready(kv_capacity=100, max_context=50)
    assert ready.limits == worker_limits(kv_capacity=100, max_context=50)   # passed on whole
    assert ready.max_running_requests == 7
    launcher_ready = harness._recv(harness.launcher, Decoder(Ready), "Ready to the launcher")
    assert launcher_ready == Ready("scheduler")
    harness.assert_no_step()


def test_malformed_worker_ready_is_skipped(harness):
    harness.spawn()
    harness.results.send(b"\x00not msgpack")
    harness.results.send(msgpack.packb([1, "worker", "info is not a map"]))
    harness.results.send(msgpack.packb([WorkerReady.TAG, "limits are not a list"]))
    harness.results.send(encode(Ready("worker")))
    harness.results.send(encode(StepResult(1, [], [], [])))
    ready = harness.worker_ready()
    assert ready.limits.kv_capacity == KV_CAPACITY
    assert harness.child.proc.poll() is None


@pytest.mark.parametrize("kv_capacity", [[], ["many"], [0]],
                         ids=["kv_capacity missing", "kv_capacity not an int", "kv_capacity 0"])
def test_worker_ready_with_bad_limits_is_skipped(harness, kv_capacity):
    """A Ready whose limits are unusable is a malformed message: logged and dropped,
    and the scheduler still takes the worker's next, valid Ready."""
    harness.spawn()
    limits = kv_capacity + worker_limits().to_wire()[1:]
    harness.results.send(msgpack.packb([WorkerReady.TAG, limits]))
    ready = harness.worker_ready()
    assert ready.limits.kv_capacity == KV_CAPACITY
    assert harness.child.proc.poll() is None


# ---- one request, start to finish ----------------------------------------------

def test_request_prefill_decode_and_length_stop(sched):
    sampling = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=11,
                              top_logprobs=2)
    sched.request(1, [5, 6, 7], max_new_tokens=3, sampling=sampling)
    used: set[int] = set()

    s1 = sched.step()
    assert s1.decode_rids == [] and s1.decodes == [] and s1.releases == []
    [p] = s1.prefills
    assert p.rid == 1 and p.input_ids == [5, 6, 7] and p.prefix_slot_ids == []
    assert p.sampling == sampling and p.needs_logits
    assert len(p.new_slot_ids) == 3
    check_slots(sched, p.new_slot_ids, used)
    top = [[[100, 3], [-0.1, -2.5]]]
    sched.answer(s1, {1: 100}, top_logprobs=top)
    # the first token carries usage: the tokenizer learns cached_tokens early
    assert sched.batch().entries == [TokenEntry(1, [100], [logprob(1, 100)], top, usage=Usage(
        prompt_tokens=3, completion_tokens=1, cached_tokens=0))]

    last_step = s1.step_id
    for n, token in enumerate([101, 102], start=2):
        step = sched.step()
        assert step.step_id > last_step
        last_step = step.step_id
        assert step.decode_rids == [1] and not step.prefills and not step.releases
        check_slots(sched, [row.slot for row in step.decodes], used)
        sched.answer(step, {1: token})
        [entry] = sched.batch().entries
        assert entry.rid == 1 and entry.token_ids == [token]
        assert entry.logprobs == [logprob(1, token)] and entry.top_logprobs is None
        if n < 3:
            assert entry.finish_reason is None and entry.usage is None
    assert entry.finish_reason == "length"
    assert entry.usage == Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=0)
    assert entry.error is None

    [release] = sched.finish_releases({1})
    assert release.releases == [1] and release.step_id > last_step
    sched.assert_no_batch()


def test_stop_token_ids_finish_with_stop(sched):
    sched.request(1, [3, 4], max_new_tokens=10, stop_token_ids=[9, 2])
    out = sched.serve({1: [7, 8, 2, 5, 5]})
    entries = out["entries"][1]
    assert [e.token_ids[0] for e in entries] == [7, 8, 2]
    assert [e.finish_reason for e in entries] == [None, None, "stop"]
    assert entries[-1].usage == Usage(prompt_tokens=2, completion_tokens=3, cached_tokens=0)
    sched.finish_releases({1})


def test_max_new_tokens_one_finishes_after_prefill(sched):
    sched.request(4, [1, 2, 3, 4], max_new_tokens=1)
    out = sched.serve({4: [50]})
    [entry] = out["entries"][4]
    assert entry.finish_reason == "length" and entry.token_ids == [50]
    assert len(out["steps"]) == 1 and out["steps"][0].prefills[0].rid == 4
    sched.finish_releases({4})


# ---- batching -------------------------------------------------------------------

def test_two_requests_share_decode_steps(sched):
    sched.request(1, [10, 11, 12], max_new_tokens=4)
    sched.request(2, [20, 21], max_new_tokens=6)
    out = sched.serve({1: [101, 102, 103, 104], 2: [201, 202, 203, 204, 205, 206]})

    shared = [s for s in out["steps"] if sorted(s.decode_rids) == [1, 2]]
    assert len(shared) >= 2, [s.decode_rids for s in out["steps"]]
    for s in shared:
        assert len({row.slot for row in s.decodes}) == 2   # a slot each
    # one TokenBatch per answered step, and it carried every request of that step
    assert len(out["batches"]) == len(out["steps"])
    assert any(len(b.entries) == 2 for b in out["batches"])
    e1, e2 = out["entries"][1], out["entries"][2]
    assert [e.token_ids[0] for e in e1] == [101, 102, 103, 104]
    assert [e.token_ids[0] for e in e2] == [201, 202, 203, 204, 205, 206]
    assert e1[-1].finish_reason == "length" and e2[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in e1[:-1] + e2[:-1])
    # once request 1 finished it is released and no longer decoded
    after = out["steps"][[i for i, s in enumerate(out["steps"]) if 1 in s.releases][0]:]
    assert all(1 not in s.decode_rids for s in after)
    sched.finish_releases({2})
    check_step_slots(sched, out["steps"])


def test_many_requests_one_batch_per_step(sched):
    rids = list(range(1, 9))
    for rid in rids:
        sched.request(rid, [rid, rid + 1, rid + 2], max_new_tokens=8)
    out = sched.serve({rid: [rid * 10 + i for i in range(8)] for rid in rids})
    assert len(out["batches"]) == len(out["steps"])
    assert max(len(s.decode_rids) for s in out["steps"]) == len(rids)
    for rid in rids:
        assert [e.token_ids[0] for e in out["entries"][rid]] == [rid * 10 + i
                                                                   for i in range(8)]
    sched.finish_releases(set(rids) - {r for s in out["steps"] for r in s.releases})
    check_step_slots(sched, out["steps"])


# ---- abort ---------------------------------------------------------------------

def test_abort_running_request(sched):
    sched.request(1, [1, 2, 3], max_new_tokens=50)
    s1 = sched.step()
    sched.answer(s1, {1: 11})
    sched.batch()
    s2 = sched.step()
    assert s2.decode_rids == [1]
    sched.requests.send(encode(Abort(1)))    # while step 2 is in flight
    [entry] = sched.batch().entries
    assert entry.rid == 1 and entry.token_ids == [] and entry.finish_reason == "abort"
    assert entry.usage.completion_tokens == 1
    sched.answer(s2, {1: 12})     # the token of an aborted request is dropped
    s3 = sched.step()
    assert s3.releases == [1] and s3.decode_rids == [] and not s3.prefills
    sched.answer(s3, {})
    sched.assert_no_batch()
    sched.assert_no_step()


def test_abort_waiting_and_unknown_requests(harness):
    harness.spawn("--max-running-requests", "1")
    harness.worker_ready()
    harness.request(1, [1, 2], max_new_tokens=3)
    harness.request(2, [3, 4], max_new_tokens=3)
    s1 = harness.step()
    assert [p.rid for p in s1.prefills] == [1]
    harness.requests.send(encode(Abort(2)))     # waiting: never reaches the worker
    harness.requests.send(encode(Abort(777)))   # unknown: ignored
    [entry] = harness.batch().entries
    assert entry.rid == 2 and entry.finish_reason == "abort" and entry.token_ids == []
    assert entry.usage.completion_tokens == 0
    harness.answer(s1, {1: 5})
    harness.batch()
    out = harness.serve({1: [6, 7]})
    assert out["entries"][1][-1].finish_reason == "length"
    steps = out["steps"] + harness.finish_releases({1})
    assert all(p.rid != 2 for s in steps for p in s.prefills)
    assert all(2 not in s.releases for s in steps)
    harness.assert_no_batch()


def test_stats_report_the_worker_limits_and_its_latest_memory(sched):
    def stats(query_id):
        sched.requests.send(encode(GetStats(query_id)))
        reply = sched._recv(sched.batches, Decoder(Stats), "Stats")
        assert reply.query_id == query_id
        return reply.stats

    assert stats(1)["worker"] == worker_limits().as_dict()
    sched.request(1, [1, 2], max_new_tokens=1)
    step = sched.step()
    timing = StepTiming(compute_ms=2.5, active_memory=123, peak_memory=456)
    sched.results.send(encode(StepResult(step.step_id, [1], [5], [-0.5], timing=timing)))
    sched.batch()
    after = stats(2)
    assert after["worker"] == {**worker_limits().as_dict(), "active_memory": 123,
                               "peak_memory": 456}
    assert after["timing"]["steps"] == 1 and after["timing"]["compute_ms"]["mean"] == 2.5
    sched.finish_releases({1})


def test_step_result_for_a_step_not_in_flight_is_dropped(sched):
    """Only the answer to the step in flight may advance requests; a result naming
    another step (stale, duplicated, or from a confused worker) is logged and dropped."""
    sched.request(1, [1, 2, 3], max_new_tokens=10)
    s1 = sched.step()
    sched.answer(s1, {1: 11})
    assert [e.token_ids for e in sched.batch().entries] == [[11]]
    s2 = sched.step()
    assert s2.decode_rids == [1]
    sched.answer(s1, {1: 66})                                 # s1 answered again
    sched.answer(Step(s2.step_id + 50), {1: 67})               # a step never sent
    sched.assert_no_batch()
    sched.assert_no_step()
    sched.answer(s2, {1: 12})
    assert [e.token_ids for e in sched.batch().entries] == [[12]]
    s3 = sched.step()
    assert s3.decode_rids == [1]
    sched.requests.send(encode(Abort(1)))
    assert sched.batch().entries[0].finish_reason == "abort"
    sched.answer(s3, {1: 13})
    sched.finish_releases({1})


# ---- worker failure --------------------------------------------------------------

def test_a_worker_error_resumes_running_requests_and_the_scheduler_keeps_serving(sched):
    sched.request(1, [1, 2, 3], max_new_tokens=3)
    sched.request(2, [4, 5], max_new_tokens=3)
    step = _until_decoding(sched, [1, 2])
    sched.results.send(encode(WorkerError(step.step_id, "boom: out of memory")))
    resume_notices(sched, [1, 2])
    sched.request(3, [7, 8, 9, 10], max_new_tokens=2)
    # the worker dropped all state: both resume, prefilling prompt + output so far
    # (no releases: the worker holds nothing of them), and nothing fails
    out = sched.serve({1: [10, 11], 2: [20, 21], 3: [30, 31]})
    first = out["steps"][0]
    assert first.decode_rids == [] and first.releases == []
    assert_resumed(first, {1: [1, 2, 3], 2: [4, 5]}, 9)
    for rid in (1, 2):
        entries = out["entries"][rid]
        assert entries[-1].usage.resumes == 1 and entries[-1].finish_reason == "length"
    assert [e.token_ids[0] for e in out["entries"][3]] == [30, 31]
    assert out["entries"][3][-1].usage.resumes == 0
    sched.finish_releases({1, 2, 3} - released(out))


def resume_notices(h: Harness, rids: list[int]) -> None:
    """The batch that tells the front end at once that `rids` were resumed: an entry
    each with no token and the usage counting one resume."""
    entries = h.batch().entries
    assert sorted(e.rid for e in entries) == sorted(rids)
    assert all(not e.token_ids and not e.finish_reason and e.usage.resumes == 1
               for e in entries)


def released(out: dict) -> set[int]:
    """The rids `serve`'s steps released (those that finished before the last)."""
    return {rid for step in out["steps"] for rid in step.releases}


def assert_resumed(step: Step, prompts: dict[int, list[int]], token: int) -> None:
    """`step` prefills each rid of `prompts` again: its prompt, then what it had
    generated (all `token`), with num_generated counting those."""
    prefills = {p.rid: p for p in step.prefills}
    for rid, prompt in prompts.items():
        p = prefills[rid]
        assert p.num_generated >= 1 and p.prefix_slot_ids == []
        assert p.input_ids == prompt + [token] * p.num_generated


def _stats(h: Harness, query_id: int) -> dict:
    h.requests.send(encode(GetStats(query_id)))
    reply = h._recv(h.batches, Decoder(Stats), "Stats")
    assert reply.query_id == query_id
    return reply.stats


def test_an_unresponsive_worker_s_requests_wait_and_resume_after_its_late_answer(harness):
    harness.spawn("--worker-timeout", "1")
    harness.worker_ready()
    assert _stats(harness, 1)["worker_status"] == "ok"
    harness.request(1, [1, 2, 3], max_new_tokens=3)
    harness.request(2, [4, 5], max_new_tokens=3)
    step = _until_decoding(harness, [1, 2])
    # the worker hangs: the step goes unanswered past the limit; its requests wait
    resume_notices(harness, [1, 2])
    assert _stats(harness, 2)["worker_status"] == "unresponsive"
    stats = _stats(harness, 3)
    assert stats["worker_step_seconds"] >= 1 and stats["running"] == 0
    assert stats["waiting"] == 2 and stats["resumes"] == 2
    harness.request(3, [7, 8, 9, 10], max_new_tokens=2)
    harness.assert_no_step()            # a later request waits for the worker
    harness.assert_no_batch(0)          # and nothing has failed

    harness.answer(step, {1: 50, 2: 51})   # it comes back: the late answer is dropped
    out = harness.serve({1: [10, 11], 2: [20, 21], 3: [30, 31]})
    first = out["steps"][0]             # it drops 1 and 2 first, then they resume
    assert sorted(first.releases) == [1, 2] and first.decode_rids == []
    assert [p.rid for p in first.prefills] == [3]
    assert_resumed(out["steps"][1], {1: [1, 2, 3], 2: [4, 5]}, 9)
    assert [out["entries"][r][-1].finish_reason for r in (1, 2, 3)] == ["length"] * 3
    assert _stats(harness, 4)["worker_status"] == "ok"
    check_step_slots(harness, out["steps"])
    harness.finish_releases({1, 2, 3} - released({"steps": out["steps"][1:]}))


def test_a_worker_answering_in_time_is_not_abandoned(harness):
    harness.spawn("--worker-timeout", "30")
    harness.worker_ready()
    harness.request(1, [1, 2], max_new_tokens=3)
    out = harness.serve({1: [5, 6, 7]})
    assert [e.finish_reason for e in out["entries"][1]] == [None, None, "length"]
    assert _stats(harness, 1)["worker_status"] == "ok"
    harness.finish_releases({1})


# ---- the worker dies and a new one replaces it ------------------------------------------

def _until_decoding(h: Harness, rids: list[int]) -> Step:
    """Answer steps until `rids` all decode; that step is left in flight."""
    while True:
        step = h.step()
        if sorted(step.decode_rids) == rids:
            return step
        done = step.decode_rids + [p.rid for p in step.prefills]
        h.answer(step, {r: 9 for r in done})
        h.batch()


def _restarting(h: Harness) -> bool:
    """Whether the scheduler noticed the worker's death (it does so on its own, soon)."""
    return wait_until(lambda: _stats(h, 0)["worker_status"] == "restarting", RECV_TIMEOUT)


def test_a_dead_worker_s_requests_resume_on_its_successor_with_the_waiting_ones(harness):
    harness.spawn("--max-running-requests", "2")
    harness.worker_ready()
    harness.request(1, [1, 2, 3], max_new_tokens=3)
    harness.request(2, [4, 5], max_new_tokens=3)
    harness.request(3, [6, 7, 8], max_new_tokens=2)    # waits: two run at most
    _until_decoding(harness, [1, 2])
    harness.worker_dies()                               # with a step in flight
    resume_notices(harness, [1, 2])                     # nothing failed
    assert _restarting(harness)
    stats = _stats(harness, 1)
    assert stats["worker_status"] == "restarting" and stats["worker_restarts"] == 1
    assert (stats["running"], stats["waiting"], stats["used_slots"]) == (0, 3, 0)
    assert stats["free_slots"] == KV_CAPACITY and stats["cached_slots"] == 0

    harness.worker_restarts()
    harness.request(4, [9, 10], max_new_tokens=2)
    harness.assert_no_step()                  # nothing is sent before the new worker's Ready
    harness.results.send(encode(WorkerReady(worker_limits())))
    out = harness.serve({1: [10, 11], 2: [20, 21], 3: [30, 31], 4: [40, 41]})
    harness.assert_no_batch()                 # no second SchedulerReady: the limits stay
    first = out["steps"][0]
    assert first.releases == [] and first.decode_rids == []
    assert_resumed(first, {1: [1, 2, 3], 2: [4, 5]}, 9)   # first: two run at most
    assert all(not p.prefix_slot_ids for s in out["steps"][1:] for p in s.prefills
               if p.rid in (3, 4))
    assert all(out["entries"][r][-1].finish_reason == "length" for r in (1, 2, 3, 4))
    harness.finish_releases({1, 2, 3, 4} - released(out))
    stats = _stats(harness, 2)
    assert stats["worker_status"] == "ok" and stats["worker_restarts"] == 1


def test_a_dead_unresponsive_worker_is_replaced_and_nothing_is_released_to_its_successor(
        harness):
    harness.spawn("--worker-timeout", "1")
    harness.worker_ready()
    harness.request(1, [1, 2, 3], max_new_tokens=3)
    _until_decoding(harness, [1])
    resume_notices(harness, [1])                       # the watchdog: it waits to resume
    assert _stats(harness, 1)["worker_status"] == "unresponsive"
    harness.worker_dies()                              # the hung worker is killed
    assert _restarting(harness)
    harness.worker_restarts()
    harness.request(2, [4, 5], max_new_tokens=1)
    harness.results.send(encode(WorkerReady(worker_limits())))
    out = harness.serve({1: [10, 11], 2: [20]})
    assert out["steps"][0].releases == []
    assert sorted(p.rid for p in out["steps"][0].prefills) == [1, 2]
    assert out["entries"][1][-1].usage.resumes == 1
    harness.finish_releases({1, 2} - released(out))


def test_a_disconnect_while_waiting_for_the_new_worker_is_no_second_death(sched):
    """A dying worker's socket may close in two steps: the socket reopened for the
    next worker can connect to its listener and lose it again at once."""
    sched.worker_dies()
    assert _restarting(sched)
    sched.worker_restarts()
    sched.assert_no_step(0.5)               # meanwhile the scheduler connects to it
    sched.worker_dies()                     # and loses it again
    # (a real worker's WorkerReady follows its model load, seconds after the closed
    # listener is reported; here the report must come first too)
    sched.wait_for_log("a lost connection while no worker serves")
    sched.worker_restarts()
    sched.results.send(encode(WorkerReady(worker_limits())))
    sched.request(1, [1, 2], max_new_tokens=1)
    out = sched.serve({1: [5]})
    assert out["entries"][1][-1].finish_reason == "length"
    stats = _stats(sched, 1)
    assert stats["worker_status"] == "ok" and stats["worker_restarts"] == 1


def test_a_new_worker_with_a_smaller_pool_stops_the_scheduler(sched):
    sched.worker_dies()
    assert _restarting(sched)
    sched.worker_restarts()
    sched.results.send(encode(WorkerReady(worker_limits(kv_capacity=KV_CAPACITY // 2))))
    assert sched.child.proc.wait(10) == 1
    assert "KV pool is smaller" in sched.child.log()


def test_a_worker_ready_while_the_worker_serves_is_ignored(sched):
    sched.request(1, [1, 2], max_new_tokens=2)
    first = sched.step()
    sched.results.send(encode(WorkerReady(worker_limits(kv_capacity=8))))
    sched.answer(first, {1: 5})
    sched.batch()
    out = sched.serve({1: [6]})
    assert out["entries"][1][-1].finish_reason == "length"
    stats = _stats(sched, 1)
    assert stats["worker_status"] == "ok" and stats["worker_restarts"] == 0
    assert sched.child.proc.poll() is None


# ---- malformed input ---------------------------------------------------------------

SP = [0.0, 1.0, 0, 0.0, None, 0]

BAD_REQUEST_FRAMES = [
    b"",
    b"\xc1",
    b"garbage\x00\xff\xfe",
    msgpack.packb({"tag": 30}),
    msgpack.packb([]),
    msgpack.packb(7),
    msgpack.packb([999, 1]),
    msgpack.packb(["30", 1, [1], SP, 4, []]),
    msgpack.packb([30]),
    msgpack.packb([30, 1, [1, 2], SP, 4]),                     # a field missing
    msgpack.packb([30, 1, [1, 2], SP, 4, [], "extra"]),
    msgpack.packb([30, "1", [1, 2], SP, 4, []]),                # rid not an int
    msgpack.packb([30, True, [1, 2], SP, 4, []]),
    msgpack.packb([30, 1.0, [1, 2], SP, 4, []]),
    msgpack.packb([30, 1, [1, "x"], SP, 4, []]),
    msgpack.packb([30, 1, [1, 2.5], SP, 4, []]),
    msgpack.packb([30, 1, {"ids": [1]}, SP, 4, []]),
    msgpack.packb([30, 1, b"\x01\x02", SP, 4, []]),
    msgpack.packb([30, 1, [1, 2], SP[:5], 4, []]),
    msgpack.packb([30, 1, [1, 2], ["hot", 1.0, 0, 0.0, None, 0], 4, []]),
    msgpack.packb([30, 1, [1, 2], [-1.0, 1.0, 0, 0.0, None, 0], 4, []]),
    msgpack.packb([30, 1, [1, 2], [0.0, 0.0, 0, 0.0, None, 0], 4, []]),
    msgpack.packb([30, 1, [1, 2], [0.0, 1.0, -1, 0.0, None, 0], 4, []]),
    msgpack.packb([30, 1, [1, 2], [0.0, 1.0, 0, 0.0, "seed", 0], 4, []]),
    msgpack.packb([30, 1, [1, 2], {"temperature": 0}, 4, []]),
    msgpack.packb([30, 1, [1, 2], SP, 0, []]),                 # max_new_tokens < 1
    msgpack.packb([30, 1, [1, 2], SP, "4", []]),
    msgpack.packb([30, 1, [1, 2], SP, 4, None]),
    msgpack.packb([30, 1, [1, 2], SP, 4, ["eos"]]),
    msgpack.packb([31]),
    msgpack.packb([31, "1"]),
    msgpack.packb([31, 1, 2]),
    encode(Step(1, [DecodeRow(1, 1)])),                         # right codec, wrong socket
    encode(StepResult(1, [1], [2], [0.0])),
    encode(Ready("tokenizer", "tcp://127.0.0.1:1")),
    encode(WorkerReady(worker_limits())),
]

TIMING = StepTiming().to_wire()
BAD_WORKER_FRAMES = [
    b"",
    b"\xc1\xc1",
    msgpack.packb({"step_id": 1}),
    msgpack.packb([999]),
    msgpack.packb([60]),
    msgpack.packb([60, "1", [1], [2], [0.0], None, TIMING]),
    msgpack.packb([60, 1, [1], [2, 3], [0.0], None, TIMING]),   # not aligned with rids
    msgpack.packb([60, 1, [1], [2], [0.0, 1.0], None, TIMING]),
    msgpack.packb([60, 1, [1], [2], [0.0], [None, None], TIMING]),
    msgpack.packb([60, 1, [1], ["2"], [0.0], None, TIMING]),
    msgpack.packb([60, 1, [1], [2], ["x"], None, TIMING]),
    msgpack.packb([60, 1, [1], [2], [0.0], "top", TIMING]),
    msgpack.packb([60, 1, [1], [2], [0.0], None, []]),
    msgpack.packb([61, "1", "boom"]),
    msgpack.packb([61, 1, 5]),
    msgpack.packb([61, 1]),
    msgpack.packb([1, "worker", 5]),
    msgpack.packb([62, [0] + worker_limits().to_wire()[1:]]),   # kv_capacity < 1
    msgpack.packb([60, 1, [1], [2], [0.0], None, {}]),          # timing is a map
    msgpack.packb([60, 1, [1], [2], [0.0], None, ["fast", None, None, 0.0, False, 0, 0]]),
    encode(TokenBatch([])),
    encode(Step(1)),
]


def test_malformed_frames_are_dropped_and_scheduler_keeps_serving(sched):
    for frame in BAD_REQUEST_FRAMES:
        sched.requests.send(frame)
    for frame in BAD_WORKER_FRAMES:       # while no step is in flight
        sched.results.send(frame)
    sched.assert_no_step()
    sched.assert_no_batch()
    assert sched.child.proc.poll() is None, sched.child.log()

    sched.request(1, [1, 2, 3], max_new_tokens=3)
    s1 = sched.step()
    for frame in BAD_WORKER_FRAMES:       # while step 1 is in flight: still in flight
        sched.results.send(frame)
    for frame in BAD_REQUEST_FRAMES:
        sched.requests.send(frame)
    sched.assert_no_step()
    sched.assert_no_batch()
    sched.answer(s1, {1: 40})
    assert [e.token_ids for e in sched.batch().entries] == [[40]]
    out = sched.serve({1: [41, 42]})
    assert out["entries"][1][-1].finish_reason == "length"
    sched.finish_releases({1})
    assert sched.child.proc.poll() is None


def test_requests_too_long_or_empty_get_error_entries(harness):
    harness.spawn()
    harness.worker_ready(kv_capacity=32, max_context=64)
    harness.request(1, list(range(1, 65)), max_new_tokens=4)   # == max_context
    harness.request(2, list(range(1, 41)), max_new_tokens=4)   # > kv_capacity
    harness.request(3, [], max_new_tokens=4)
    harness.request(4, list(range(1, 33)), max_new_tokens=4)   # == kv_capacity
    errors = []
    while len(errors) < 4:
        errors += harness.batch().entries
    by_rid = {e.rid: e for e in errors}
    assert sorted(by_rid) == [1, 2, 3, 4]
    for e in errors:
        assert e.finish_reason == "error" and e.token_ids == [] and e.error
        assert e.usage is None
    assert "context" in by_rid[1].error
    assert "KV cache" in by_rid[2].error and "KV cache" in by_rid[4].error
    harness.assert_no_step()

    # 10 prompt tokens + 30 asked > 32 slots: refused up front, nothing runs
    harness.request(5, list(range(1, 11)), max_new_tokens=30)
    [refused] = harness.batch().entries
    assert refused.rid == 5 and refused.finish_reason == "error" and refused.usage is None
    assert "max_tokens" in refused.error and "32" in refused.error
    harness.assert_no_step()

    # 10 + 23 (the last token needs no slot) fill the 32 slots exactly: served
    harness.request(6, list(range(1, 11)), max_new_tokens=23)
    steps, entries = [], []
    while not (entries and entries[-1].finish_reason):
        step = harness.step()
        steps.append(step)
        rids = step.decode_rids + [p.rid for p in step.prefills if p.needs_logits]
        harness.answer(step, {rid: 100 + len(entries) for rid in rids})
        if rids:
            entries += harness.batch().entries
    tokens = [t for e in entries for t in e.token_ids]
    assert tokens == list(range(100, 123))     # 10 + 22 decodes fill the 32 slots
    assert entries[-1].finish_reason == "length"
    assert entries[-1].usage == Usage(prompt_tokens=10, completion_tokens=23, cached_tokens=0)
    check_step_slots(harness, steps)
    harness.finish_releases({6})
    harness.assert_no_batch()


@pytest.mark.parametrize("flags,hit", [((), True), (("--disable-radix-cache",), False)],
                         ids=["radix", "no-radix"])
def test_a_repeated_prompt_reuses_the_cached_prefix(harness, flags, hit):
    harness.spawn(*flags)
    harness.worker_ready()
    prompt = list(range(1, 21))
    harness.request(1, prompt, max_new_tokens=1)
    out = harness.serve({1: [50]})
    [first] = out["steps"][0].prefills
    harness.finish_releases({1})

    harness.request(2, prompt, max_new_tokens=2)
    s1 = harness.step()
    [p] = s1.prefills
    if hit:     # all but the last prompt token come from the pool
        assert p.prefix_slot_ids == first.new_slot_ids[:19] and p.input_ids == [20]
    else:
        assert p.prefix_slot_ids == [] and p.input_ids == prompt
    harness.answer(s1, {2: 60})
    [entry] = harness.batch().entries
    cached = 19 if hit else 0
    assert entry.usage == Usage(prompt_tokens=20, completion_tokens=1, cached_tokens=cached)
    out = harness.serve({2: [61]})
    assert out["entries"][2][-1].usage.cached_tokens == cached
    harness.finish_releases({2})


# ---- lifecycle ----------------------------------------------------------------------

def test_sigterm_exits_while_serving(sched):
    sched.request(1, [1, 2], max_new_tokens=100)
    sched.step()                             # a step in flight, never answered
    code = sched.child.sigterm(5)
    assert code == 0, sched.child.log()


def test_sigterm_exits_before_worker_ready(harness):
    harness.spawn()
    # its worker socket is bound after the signal handlers are installed
    assert wait_until(lambda: (harness.dir / "worker_out").exists(), 10), harness.child.log()
    code = harness.child.sigterm(5)
    assert code == 0, harness.child.log()


INTERMEDIATE = (
    "import os, subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, *sys.argv[1:], '--parent-pid', str(os.getpid())])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_exits_when_parent_dies(harness):
    harness.start_child("-c", INTERMEDIATE, *harness.argv())
    pid = None

    def grandchild_pid():
        nonlocal pid
        found = re.search(r"^(\d+)$", harness.child.log(), re.M)
        pid = int(found.group(1)) if found else None
        return pid

    try:
        assert wait_until(grandchild_pid, 10), harness.child.log()
        harness.worker_ready()               # the grandchild is up and serving
        assert pid_alive(pid)
        harness.child.proc.kill()            # SIGKILL the intermediate parent
        harness.child.proc.wait(5)
        if not wait_until(lambda: not pid_alive(pid), 10):
            raise AssertionError("the scheduler outlived its parent by 10 s:\n"
                                 + harness.child.log())
    finally:
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_front_end_gone_aborts_everything_and_a_new_one_gets_the_whole_cache(sched):
    sched.request(1, list(range(1, 40)), max_new_tokens=2)
    out = sched.serve({1: [50, 51]})
    assert out["entries"][1][-1].finish_reason == "length"
    held: set[int] = set()   # what the events said the cache holds
    for batch in sched.batches.cache_batches + out["batches"]:
        if batch.cache_reset:
            held.clear()
        held = (held - set(batch.cache_removed)) | set(batch.cache_stored)
    assert len(held) == 2   # 39 prompt tokens + the first output token: two blocks
    sched.request(2, [7, 8, 9], max_new_tokens=100)
    sched.step()
    # the front end goes away with request 2 running: it is aborted
    sched.batches.close()
    sched.sockets.remove(sched.batches)
    # a new front end at the same address: the engine joins it again, cache included
    sched.batches = sched.requests = RouterEnd(sched.ctx, sched.addr["frontend"],
                                               skip_cache_events=False)
    sched.sockets.append(sched.batches)
    ready = sched._recv(sched.batches, sched.batch_decoder, "SchedulerReady again", 15)
    while not isinstance(ready, SchedulerReady):   # the aborted request's finish came first
        ready = sched._recv(sched.batches, sched.batch_decoder, "SchedulerReady again", 15)
    snapshot = sched._recv(sched.batches, sched.batch_decoder, "the whole cache", 15)
    assert snapshot.cache_reset and set(snapshot.cache_stored) == held
