"""Recurrent-state and sliding-window models under memory pressure: the real Scheduler driving the real
ModelRunner in one process (deterministic arrivals, so each case happens on purpose),
greedy tokens and chosen-token logprobs against mlx_lm's.

The cases are the ones where a row's recurrent state can go wrong while its KV stays
right: a prompt whose last chunk is short, rows resuming from snapshots of different
prefix lengths in one forward (a second copy of a prompt, a retracted request), and
retraction followed by a resume at every chunk boundary."""

import random

import pytest

from mlxd.protocol import SamplingParams, TokenizedRequest
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.runtime.kv_layout import DECODE_PAGE
from mlxd.worker_proc.kv_pool import KVPool
from mlxd.worker_proc.model_runner import probe_geometry, runner_for
from support import PROMPTS, encode, load_reference, pressure_prompts, reference_tokens
from test_hybrid_runner import RECURRENT, WINDOWED

MAX_TOKENS = 24


class Engine:
    """Scheduler + ModelRunner, no sockets: the server's step loop in one process."""

    def __init__(self, path: str, kv_capacity: int, chunk: int, overlap: bool = True,
                 max_running: int = 64):
        model, _ = load_reference(path)
        geometry = probe_geometry(model)
        states = max_running if geometry.state_shapes else 0
        # as the worker holds them: in pages every layer is in the pool (no window pool)
        window = max(geometry.cache_layout.windows, default=0)
        self.runner = runner_for(model, KVPool(geometry, kv_capacity, 2 * states,
                                                 page=DECODE_PAGE),
                                  overlap=overlap)
        self.scheduler = Scheduler(SchedulerLimits(
            kv_capacity=kv_capacity, max_context=4096, chunked_prefill_size=chunk,
            max_running_requests=max_running, state_slots=states, snapshot_slots=states,
            window=window, decode_page=self.runner.decode_page))
        self.out: dict[int, list[tuple[int, float]]] = {}

    def add(self, rid: int, ids: list[int], max_tokens: int = MAX_TOKENS) -> None:
        self.out[rid] = []
        self.scheduler.add_request(TokenizedRequest(rid, ids, SamplingParams(), max_tokens, []))

    def step(self) -> bool:
        """One scheduler step through the worker; False when there was nothing to do."""
        step = self.scheduler.schedule()
        if step is None:
            return False
        self.scheduler.process_result(self.runner.run(step))
        for entry in self.scheduler.take_outputs():
            assert entry.error is None, entry.error
            self.out[entry.rid] += list(zip(entry.token_ids, entry.logprobs))
        self.scheduler.check_integrity()
        return True

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.step():
                self.runner.close()
                return
        raise AssertionError("the engine did not go idle")


def assert_all_match(path: str, prompts: dict[int, list[int]], out: dict) -> None:
    wrong = []
    for rid, ids in prompts.items():
        ref = reference_tokens(path, ids, MAX_TOKENS, ignore_eos=True)
        got = out[rid]
        if [t for t, _ in got] != [t for t, _ in ref] or \
                max(abs(a[1] - b[1]) for a, b in zip(got, ref)) >= 1e-3:
            wrong.append((rid, len(ids)))
    assert not wrong, f"(rid, prompt length) differing from mlx_lm: {wrong}"


@pytest.mark.parametrize("arch", RECURRENT + WINDOWED)
def test_duplicated_prompts_under_pressure_match_mlx_lm(arch, hybrid_model):
    """The pressure scenario: a 480-slot pool, chunks of 40, 36 requests at once;
    then the same 36 again, each second copy arriving as its first copy's prompt is
    done, so second copies resume from first copies' snapshots (10 new tokens after
    40 for the 50-token prompt, after 200 for the 210-token one: one forward) while
    requests are retracted and resumed."""
    path = hybrid_model(arch)
    prompts = pressure_prompts(path)
    e = Engine(path, kv_capacity=480, chunk=40)
    first = {rid: ids for rid, ids in enumerate(prompts[::2])}
    second = {rid + 100: ids for rid, ids in first.items()}
    for rid, ids in first.items():
        e.add(rid, ids)
    for _ in range(2000):
        for rid in [r for r in second if r not in e.out and e.out[r - 100]]:
            e.add(rid, second[rid])
        if not e.step() and len(e.out) == len(first) + len(second):
            break
    e.runner.close()
    assert e.scheduler.num_retractions > 0
    assert_all_match(path, {**first, **second}, e.out)


@pytest.mark.parametrize("arch", RECURRENT + WINDOWED)
def test_short_last_chunks_and_snapshot_resumes_in_one_forward_match_mlx_lm(arch, hybrid_model):
    """Chunks of 40. Prompts of 50 and 250 tokens run first (snapshots at 40 and
    240). A 210-token prompt then prefills; as its last chunk (10 tokens after 200)
    is due, second copies of all three arrive: each resumes from a snapshot with 10
    new tokens (after 200, 240 and 40), so five rows of 10 new tokens after
    prefixes of three lengths share one forward. Both copies of the 210-token
    prompt went wrong here while their KV was right."""
    path = hybrid_model(arch)
    rng = random.Random(1)
    prompts = {rid: [rng.randrange(3, 500) for _ in range(n)]
               for rid, n in ((0, 50), (1, 250), (2, 210))}
    e = Engine(path, kv_capacity=4096, chunk=40)
    e.add(0, prompts[0])
    e.add(1, prompts[1])
    e.run()
    e.add(2, prompts[2])
    while 2 not in e.scheduler.running or len(e.scheduler.running[2].slot_ids) < 200:
        assert e.step()
    copies = {rid + 10: ids for rid, ids in prompts.items()}
    for rid, ids in copies.items():
        e.add(rid, ids)
    e.run()
    assert all(e.out[rid][0] for rid in copies)
    assert_all_match(path, {**prompts, **copies}, e.out)


@pytest.mark.parametrize("chunk", [7, 40])
@pytest.mark.parametrize("arch", RECURRENT + WINDOWED)
def test_a_retraction_at_every_chunk_boundary_resumes_exactly(arch, chunk, hybrid_model):
    """A long prompt retracted after each of its chunks in turn (and once after its
    first decoded tokens), beside a running row; every resume restarts from the
    snapshot of the chunk it reached and ends equal to mlx_lm."""
    path = hybrid_model(arch)
    rng = random.Random(2)
    ids = [rng.randrange(3, 500) for _ in range(3 * chunk + chunk // 3 + 1)]
    chunks = -(-len(ids) // chunk)
    prompts, out = {}, {}
    for k in range(1, chunks + 2):   # after chunk k (k == chunks + 1: after decoding)
        e = Engine(path, kv_capacity=4096, chunk=chunk)
        e.add(0, encode(path, PROMPTS[3]))
        e.add(1, ids)
        running = e.scheduler.running
        while 1 not in running or (len(running[1].slot_ids) < min(k * chunk, len(ids))
                                   or (k > chunks and len(running[1].output_ids) < 3)):
            assert e.step()
        e.scheduler._retract(running[1])   # as memory pressure would
        e.run()
        prompts[k], out[k] = ids, e.out[1]
        assert e.scheduler.num_retractions == 1
    assert_all_match(path, prompts, out)
