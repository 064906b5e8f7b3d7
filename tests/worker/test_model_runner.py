"""ModelRunner in-process against mlx_lm: tokens, logprobs and the KV pool contents."""

import itertools
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxd.protocol import REPETITION_CONTEXT, DecodeRow, PrefillInput, SamplingParams, Step
from penalty_reference import reference_penalised_tokens
from support import PROMPTS, PageBooker, decode_rows, encode, load_reference, reference_tokens
from mlxd.runtime.kv_layout import DECODE_PAGE
from mlxd.worker_proc.kv_pool import KVPool
from mlxd.worker_proc.model_runner import probe_geometry, runner_for

MAX_TOKENS = 20


class Driver:
    """Plays the scheduler: hands out slot ids as its allocator does (in pages of the
    pool, position p at offset p mod page, a page taken whole by one request; `page`
    1: one after another) and records what comes back."""

    def __init__(self, model_path: str, capacity: int = 8192, overlap: bool = False,
                 state_slots: int = 0, window_capacity: int = 0, decode_layout: str = "auto",
                 page: int = DECODE_PAGE):
        model, _ = load_reference(model_path)
        self.model = model
        if window_capacity and decode_layout == "auto":   # a window pool is padded's
            decode_layout = "padded"
        pool = KVPool(probe_geometry(model), capacity, state_slots, window_capacity, page=page)
        self.runner = runner_for(model, pool, overlap=overlap, decode_layout=decode_layout)
        self.book = PageBooker(capacity, page)
        self.page = page
        self.step_id = itertools.count(1)
        self.running: list[int] = []
        self.slot_ids: dict[int, list[int]] = {}
        self.out: dict[int, list[tuple[int, float]]] = {}

    def new_slots(self, rid: int, n: int, start: int | None = None) -> list[int]:
        """Slots for the request's next `n` positions (from `start`: after a prefix)."""
        slots = self.book.slots(rid, n, start)
        self.slot_ids.setdefault(rid, []).extend(slots)
        return slots

    def step(self, prefills=(), releases=()):
        self.running = [r for r in self.running if r not in releases]
        for rid in releases:
            self.book.forget(rid)
        decode_slots = [self.new_slots(rid, 1)[0] for rid in self.running]
        chain_pages = [self.book.book_next(rid) for rid in self.running] if self.page > 1 else []
        rows = decode_rows(self.running, decode_slots, self.window_ids(decode_slots), chain_pages)
        result = self.runner.run(Step(next(self.step_id), rows, list(prefills), list(releases)))
        for rid, tok, lp in zip(result.rids, result.tokens, result.logprobs):
            self.out.setdefault(rid, []).append((tok, lp))
        self.running += [p.rid for p in prefills if p.needs_logits]
        return result

    def window_ids(self, slots: list[int]) -> list[int]:
        """The window ids of these slots' positions (none: no window pool)."""
        return []

    def prefill(self, rid, ids, prefix_slots=(), sampling=None, needs_logits=True):
        return PrefillInput(rid, ids, list(prefix_slots),
                            self.new_slots(rid, len(ids), len(prefix_slots)),
                            sampling or SamplingParams(), needs_logits)


def assert_matches_reference(model_path, input_ids, got):
    ref = reference_tokens(model_path, input_ids, MAX_TOKENS)
    got = got[:len(ref)]
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert max(abs(a[1] - b[1]) for a, b in zip(got, ref)) < 1e-3


LAYOUTS = pytest.mark.parametrize("layout", ["paged", "padded"])


@LAYOUTS
@pytest.mark.parametrize("model_fixture", ["llama_model", "qwen3_model"])
def test_staggered_batch_matches_mlx_lm(model_fixture, request, layout):
    path = request.getfixturevalue(model_fixture)
    d = Driver(path, decode_layout=layout)
    ids = [encode(path, p) for p in PROMPTS]
    for step in range(MAX_TOKENS + 6):
        joining = [d.prefill(r, ids[r]) for r in range(len(ids)) if r % 3 == step]
        done = [r for r in d.running if len(d.out[r]) >= MAX_TOKENS]
        d.step(joining, done)
    for r in range(len(ids)):
        assert_matches_reference(path, ids[r], d.out[r])


def test_prefix_from_pool_matches_full_prefill(llama_model):
    d = Driver(llama_model)
    full = encode(llama_model, PROMPTS[5])
    split = len(full) // 2
    d.step([d.prefill(1, full[:split], needs_logits=False)])   # only fills the pool
    d.step([d.prefill(2, full[split:], prefix_slots=d.slot_ids[1][:split])])
    for _ in range(MAX_TOKENS - 1):
        d.step()
    assert_matches_reference(llama_model, full, d.out[2])


def assert_pool_holds_mlx_lm_kv(d: "Driver", rid: int, prompt_ids: list[int]) -> None:
    """The pool slots of `rid` hold the KV mlx_lm computes for its prompt and output."""
    tokens = prompt_ids + [t for t, _ in d.out[rid]][:-1]   # the last token has no KV yet
    cache = make_prompt_cache(d.model)
    d.model(mx.array(tokens)[None], cache=cache)
    slots = mx.array(d.slot_ids[rid])
    assert len(d.slot_ids[rid]) == len(tokens)
    for layer, c in enumerate(cache):
        got_k, got_v = d.runner.pool.read(layer, slots)
        assert mx.allclose(got_k, c.keys[0, :, :len(tokens), :], atol=1e-4).item()
        assert mx.allclose(got_v, c.values[0, :, :len(tokens), :], atol=1e-4).item()


def test_pool_holds_the_kv_mlx_lm_computes(llama_model):
    """Prefill and decode KV land exactly at the slots the scheduler sent."""
    d = Driver(llama_model)
    ids = encode(llama_model, PROMPTS[3])
    d.step([d.prefill(7, ids)])
    for _ in range(5):
        d.step()
    assert_pool_holds_mlx_lm_kv(d, 7, ids)


@LAYOUTS
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_pool_writes_skip_released_rows(llama_model, overlap, layout):
    """With a released row still in the decode caches (padded), or gone from the
    pages at once, and, chained, a decode launched before the release, each
    survivor's decode KV still lands at its own slots."""
    d = Driver(llama_model, decode_layout=layout)
    d.runner.overlap = overlap
    ids = [encode(llama_model, p) for p in PROMPTS] + [encode(llama_model, PROMPTS[1] + " a")]
    d.step([d.prefill(r, ids[r]) for r in range(9)])
    d.step()
    d.step(releases=[4])   # padded: 1 of 9 rows dead, it stays in the caches
    dead = d.runner.batch.row_rids.count(None) if layout == "padded" else 1
    assert dead == 1 and 4 not in d.runner.batch.rids
    for _ in range(3):
        d.step()
    d.runner.close()
    for rid in (3, 5, 8):   # before and after the dead row
        assert_pool_holds_mlx_lm_kv(d, rid, ids[rid])


@LAYOUTS
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_pool_writes_survive_compactions_and_joins(llama_model, overlap, layout):
    """Releases that compact the caches between a chained decode's launch and its
    commit, a join in the same step, a dead row, then another compaction."""
    d = Driver(llama_model, decode_layout=layout)
    d.runner.overlap = overlap
    ids = [encode(llama_model, p) for p in PROMPTS] + [encode(llama_model, PROMPTS[1] + " a")]
    d.step([d.prefill(r, ids[r]) for r in range(8)])
    d.step()
    d.step([d.prefill(8, ids[8])], releases=[2, 6])   # 2 of 8 dead: compacted; 8 joins
    assert None not in d.runner.batch.row_rids
    d.step(releases=[0])          # 1 dead row stays
    d.step(releases=[3, 5])       # 3 of 7 dead: compacted
    for _ in range(4):
        d.step()
    d.runner.close()
    for rid in (1, 4, 7, 8):
        assert_pool_holds_mlx_lm_kv(d, rid, ids[rid])


def test_seeded_sampling_ignores_batch_neighbours(llama_model):
    ids = encode(llama_model, PROMPTS[0])
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(with_neighbours: bool):
        d = Driver(llama_model)
        prefills = [d.prefill(1, ids, sampling=sampling)]
        if with_neighbours:
            prefills += [d.prefill(2, encode(llama_model, PROMPTS[1])),
                         d.prefill(3, ids, sampling=SamplingParams(temperature=1.0, seed=5))]
        d.step(prefills)
        for _ in range(15):
            d.step()
        return [t for t, _ in d.out[1]]

    assert run(False) == run(True)


def test_mismatched_decode_set_is_rejected(llama_model):
    d = Driver(llama_model)
    d.step([d.prefill(1, encode(llama_model, PROMPTS[0]))])
    with pytest.raises(ValueError, match="do not match"):
        d.runner.run(Step(99, decode_rows([1, 2], [500, 501])))


def test_slot_ids_outside_the_pool_are_rejected(llama_model):
    d = Driver(llama_model, capacity=64)   # one page: slots 64..127 (page 0 is padding)
    with pytest.raises(ValueError, match="slot id"):
        d.runner.run(Step(1, prefills=[PrefillInput(1, [1, 2], [], [127, 128], SamplingParams())]))
    with pytest.raises(ValueError, match="slot id"):
        d.runner.run(Step(1, prefills=[PrefillInput(1, [1, 2], [], [0, 64], SamplingParams())]))
    d.step([d.prefill(1, [1, 2])])
    with pytest.raises(ValueError, match="slot id"):   # a chain page past the pool
        d.runner.run(Step(9, [DecodeRow(1, 66, chain_page=2)]))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_memory_stays_flat_over_many_decode_steps(llama_model, overlap):
    """Each step's pool writes are evaluated with it (or with the chained decode);
    nothing lazy piles up."""
    d = Driver(llama_model)
    d.runner.overlap = overlap
    ids = [encode(llama_model, p) for p in PROMPTS]
    d.step([d.prefill(r, ids[r]) for r in range(len(ids))])
    for _ in range(20):
        d.step()
    before = mx.get_active_memory()
    for _ in range(80):
        d.step()
    d.runner.close()
    assert mx.get_active_memory() - before < 1_000_000


def test_prefix_prefills_of_different_lengths_share_one_group(llama_model):
    """Rows with cached prefixes of 5, 12 and 20 tokens and 6 new tokens each run
    in one left-padded forward; each matches mlx_lm on its full prompt."""
    from mlxd.worker_proc.prefill import plan_groups

    d = Driver(llama_model)
    base = encode(llama_model, PROMPTS[6])
    d.step([d.prefill(1, base, needs_logits=False)])
    tails = {2: encode(llama_model, " mountain river")[1:] * 3,
             3: encode(llama_model, " water people")[1:] * 3,
             4: encode(llama_model, " France Paris")[1:] * 3}
    prefills = [d.prefill(rid, tails[rid][:6], prefix_slots=d.slot_ids[1][:n])
                for rid, n in ((2, 5), (3, 12), (4, 20))]
    assert len(plan_groups(prefills, 2048)) == 1
    d.step(prefills)
    for _ in range(MAX_TOKENS - 1):
        d.step()
    for rid, n in ((2, 5), (3, 12), (4, 20)):
        assert_matches_reference(llama_model, base[:n] + tails[rid][:6], d.out[rid])


def run_scenario(model_path, overlap: bool, sampling=None):
    """Arrivals mid-stream, finishes at different steps, an abort, max_tokens 1 and 2."""
    d = Driver(model_path)
    d.runner.overlap = overlap
    ids = [encode(model_path, p) for p in PROMPTS]
    limit = {0: 1, 1: 2, 2: 9, 3: 14, 4: 20, 5: 20, 6: 6, 7: 20}   # tokens per rid
    arrive = {0: [0, 1, 2, 3], 3: [4, 5], 5: [6, 7]}
    aborted = {9: 5}                                                 # step -> rid
    for step in range(30):
        joining = [d.prefill(r, ids[r], sampling=sampling) for r in arrive.get(step, [])]
        done = [r for r in d.running if len(d.out[r]) >= limit[r] or aborted.get(step) == r]
        d.step(joining, done)
    return {rid: d.out[rid][:limit[rid]] for rid in d.out}


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_k=40, seed=9)],
                         ids=["greedy", "seeded"])
def test_overlap_gives_the_tokens_of_no_overlap(llama_model, sampling):
    chained, plain = run_scenario(llama_model, True, sampling), run_scenario(llama_model, False, sampling)
    assert chained.keys() == plain.keys()
    for rid in plain:
        assert [t for t, _ in chained[rid]] == [t for t, _ in plain[rid]], rid
        assert max(abs(a[1] - b[1]) for a, b in zip(chained[rid], plain[rid])) < 1e-4


def test_overlap_chains_the_next_decode(llama_model):
    d = Driver(llama_model)
    d.runner.overlap = True
    first = d.step([d.prefill(1, encode(llama_model, PROMPTS[0]))])
    assert d.runner.chained is not None and not first.timing.chained
    result = d.step()
    assert result.timing.chained is True and result.timing.chained_wait_ms >= 0
    assert d.runner.chained is not None
    d.step(releases=[1])
    assert d.runner.chained is None and len(d.runner.batch) == 0
    assert not d.runner._background.running


def test_a_failed_chained_decode_fails_the_next_step_and_reset_recovers(llama_model):
    d = Driver(llama_model)
    d.runner.overlap = True
    d.step([d.prefill(1, encode(llama_model, PROMPTS[0]))])
    d.runner._background.wait()
    d.runner._background.start(lambda: 1 / 0)   # as if the chained decode had raised
    with pytest.raises(ZeroDivisionError):
        d.step()
    d.runner.reset()
    assert len(d.runner.batch) == 0 and d.runner.chained is None
    assert not d.runner._background.running
    d.running = []
    d.step([d.prefill(2, encode(llama_model, PROMPTS[1]))])
    for _ in range(MAX_TOKENS - 1):
        d.step()
    assert_matches_reference(llama_model, encode(llama_model, PROMPTS[1]), d.out[2])


def test_step_timing_accounts_for_the_wait(llama_model):
    d = Driver(llama_model)
    d.runner.overlap = False
    d.step([d.prefill(1, encode(llama_model, PROMPTS[0]))])
    time.sleep(0.05)
    t = d.step().timing
    assert t.wait_ms >= 50 and t.idle_ms >= 50 and t.compute_ms > 0
    d.step(releases=[1])   # nothing runs now: the next wait is for work, not a round trip
    time.sleep(0.05)
    t = d.step([d.prefill(2, encode(llama_model, PROMPTS[1]))]).timing
    assert t.wait_ms is None and t.idle_ms is None and t.compute_ms > 0


def test_chained_step_timing_reports_the_wait_as_busy(llama_model):
    d = Driver(llama_model)
    d.runner.overlap = True
    d.step([d.prefill(1, encode(llama_model, PROMPTS[0]))])
    t = d.step().timing   # arrives at once: the chained decode is still computing or done
    assert t.chained and t.idle_ms <= t.wait_ms and t.chained_wait_ms >= 0


def decode_cache_bytes(batch) -> int:
    """What a decode step would copy were it not written in place: the rows' store."""
    if getattr(batch, "pool", None) is not None:   # the rows read the pool
        return batch.pool.nbytes
    if hasattr(batch, "arena"):
        return batch.arena.nbytes
    return sum(c.keys.nbytes + c.values.nbytes for c in batch.caches)


@LAYOUTS
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_decode_steps_update_the_caches_in_place(llama_model, overlap, layout):
    """A decode step writes one position into each row's cache (or page); nothing may
    hold the caches' previous buffers meanwhile (a pending pool write did, with
    overlap), or every step copies every layer's whole cache (seconds per step at
    serving sizes)."""
    d = Driver(llama_model, decode_layout=layout)
    d.runner.overlap = overlap
    long = [(i % 400) + 10 for i in range(900)]   # a wide cache: 8 rows x ~1024 positions
    d.step([d.prefill(r, long[r:] + long[:r]) for r in range(8)])
    for _ in range(3):
        d.step()
    d.runner.close()
    cache_bytes = decode_cache_bytes(d.runner.batch)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for _ in range(6):
        d.step()
    d.runner.close()
    assert mx.get_peak_memory() - before < cache_bytes / 4


def test_released_rows_wait_for_the_next_join_and_every_output_stays_exact(llama_model):
    """Released rows stay in the caches (dead) until a join copies the batch anyway,
    or until they are more than 1/8 of the rows (the padded layout); outputs are
    unaffected."""
    d = Driver(llama_model, decode_layout="padded")
    ids = [encode(llama_model, p) for p in PROMPTS]
    ids += [ids[0] + ids[2], ids[3] + ids[1]]
    d.step([d.prefill(r, ids[r]) for r in range(9)])
    d.step()
    d.step([d.prefill(9, ids[9])], releases=[1])   # the join leaves the new dead row out
    assert None not in d.runner.batch.row_rids and len(d.runner.batch) == 9
    d.step(releases=[2])             # 1 of 9 rows dead: kept until later
    assert d.runner.batch.row_rids.count(None) == 1 and len(d.runner.batch) == 8
    d.step()
    d.step(releases=[0])             # 2 of 9 dead: more than 1/8, compacted now
    assert None not in d.runner.batch.row_rids and len(d.runner.batch) == 7
    for _ in range(MAX_TOKENS):
        d.step()
    for r in (3, 4, 5, 6, 7, 8, 9):
        assert_matches_reference(llama_model, ids[r], d.out[r])


# ---- penalties, logit_bias, min_tokens in the batch ---------------------------------

PENALISED = {
    # the bias brings token 5 back and again, the penalties push it away
    2: SamplingParams(presence_penalty=2.0, frequency_penalty=3.0, bias_ids=[5],
                      bias_values=[30.0]),
    4: SamplingParams(repetition_penalty=1.6, bias_ids=[7, 11], bias_values=[3.0, -5.0]),
    5: SamplingParams(frequency_penalty=2.0, repetition_penalty=1.2, min_tokens=4),
}


def penalised_prefill(d: Driver, rid: int, prompt: list[int], output: list[int],
                      stop_ids=()) -> PrefillInput:
    """What the scheduler sends to start (or, with `output`, resume) a penalised row."""
    ids = prompt + output
    return PrefillInput(rid, ids, [], d.new_slots(rid, len(ids)), PENALISED[rid],
                        num_generated=len(output), prompt_tail=prompt[-REPETITION_CONTEXT:],
                        output_ids=list(output), stop_token_ids=list(stop_ids))


def run_mixed(model_path, overlap: bool, retract_at: int | None = None):
    """Plain rows 1 and 3 share the batch with penalised rows 2, 4 and 5; with
    `retract_at`, rows 2 and 5 are released at that step and resumed the next with
    prompt + output, as after a retraction."""
    d = Driver(model_path)
    d.runner.overlap = overlap
    ids = {rid: encode(model_path, PROMPTS[rid]) for rid in (1, 2, 3, 4, 5)}
    # row 5's stop ids are the tokens it would pick first: min_tokens must hold them back
    stops = {5: [t for t, _ in reference_tokens(model_path, ids[5], 2, ignore_eos=True)]}
    d.step([d.prefill(1, ids[1]), d.prefill(3, ids[3])]
           + [penalised_prefill(d, rid, ids[rid], [], stops.get(rid, ())) for rid in PENALISED])
    for step in range(1, MAX_TOKENS):
        if step == retract_at:
            d.step(releases=[2, 5])
            d.step([penalised_prefill(d, rid, ids[rid], [t for t, _ in d.out[rid]],
                                      stops.get(rid, ())) for rid in (2, 5)])
        else:
            d.step()
    return d, ids, stops


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
@pytest.mark.parametrize("retract_at", [None, 6], ids=["running", "resumed"])
def test_penalised_rows_share_the_batch_and_decode_as_the_reference(llama_model, overlap,
                                                                   retract_at):
    d, ids, stops = run_mixed(llama_model, overlap, retract_at)
    for rid in (1, 3):   # the plain rows: what they get alone
        alone = Driver(llama_model)
        alone.step([alone.prefill(rid, ids[rid])])
        for _ in range(len(d.out[rid]) - 1):
            alone.step()
        assert [t for t, _ in d.out[rid]] == [t for t, _ in alone.out[rid]]
        assert max(abs(a[1] - b[1]) for a, b in zip(d.out[rid], alone.out[rid])) < 1e-5
    for rid, params in PENALISED.items():
        n = len(d.out[rid])
        want = reference_penalised_tokens(llama_model, ids[rid], params, n, stops.get(rid, ()))
        assert [t for t, _ in d.out[rid]] == want, rid


def test_penalised_rows_report_the_raw_logprobs(llama_model):
    """The chosen tokens' logprobs are the model's log-softmax before processing."""
    d, ids, _ = run_mixed(llama_model, overlap=False)
    model, _ = load_reference(llama_model)
    tokens = [t for t, _ in d.out[4]]
    logits = model(mx.array([ids[4] + tokens[:-1]]))[0, len(ids[4]) - 1:].astype(mx.float32)
    raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = raw[mx.arange(len(tokens)), mx.array(tokens)].tolist()
    assert max(abs(a - b) for (_, a), b in zip(d.out[4], want)) < 1e-3


@pytest.mark.parametrize("case", ["last-piece", "middle-chunk", "beside-a-decode"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_a_prefill_from_a_cached_prefix_writes_the_pool_in_place(llama_model, overlap, case):
    """A prefill reads its prefix from the pool and writes its new KV into the pool in
    the same step (a join copies the positions of a prefix that ends inside a page
    into the row's own page; a decode beside it reads the pool too). Were a read
    still pending when a write runs, MLX could not write in place and every such
    step would copy every layer's whole pool (~0.6 s a layer at serving sizes)."""
    d = Driver(llama_model, capacity=1 << 17, overlap=overlap)
    ids = [(i % 400) + 10 for i in range(300)]
    d.step([d.prefill(1, ids[:200], needs_logits=case == "beside-a-decode")])
    for _ in range(2):
        d.step()
    d.runner.close()
    one_layer = d.runner.pool.keys[0][0].nbytes   # what a copy of one layer's keys takes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    d.step([d.prefill(2, ids[200:], prefix_slots=d.slot_ids[1][:200],
                      needs_logits=case != "middle-chunk")])
    d.step()
    d.runner.close()
    assert mx.get_peak_memory() - before < one_layer / 2
