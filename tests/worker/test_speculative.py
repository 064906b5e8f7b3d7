"""Speculative decoding end to end: the real Scheduler proposing n-gram drafts and the
real ModelRunner verifying them, in one process (no sockets).

Greedy rows match mlx_lm token for token; seeded rows give the tokens they give with
speculation off; unseeded rows keep their distribution; stops and lengths inside an
accepted run cut it there; models that cannot verify drafts get none; the worker
refuses drafts it cannot take. Prompts repeat a block of random ids, so the n-gram
drafter finds matches and the random-weight models accept some of them."""

import random
from dataclasses import replace

import pytest

from mlxd.protocol import DecodeRow, ProtocolError, SamplingParams, Step, TokenizedRequest
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.scheduler_proc.speculation import SpecConfig
from mlxd.runtime.kv_layout import DECODE_PAGE
from mlxd.worker_proc.kv_pool import KVPool
from mlxd.worker_proc.model_runner import probe_geometry, runner_for
from support import PROMPTS, encode, load_reference, reference_tokens
from test_hybrid_runner import RECURRENT, WINDOWED

NGRAM = SpecConfig("ngram")
OFF = SpecConfig("off")


def repeated(seed: int, block: int = 12, times: int = 4, tail: int = 0) -> list[int]:
    """A block of random ids `times` over (and `tail` random ids after it)."""
    rng = random.Random(seed)
    base = [rng.randrange(5, 500) for _ in range(block)]
    return base * times + [rng.randrange(5, 500) for _ in range(tail)]


class Engine:
    """Scheduler + ModelRunner with speculation configured: the server's step loop in
    one process. Records every entry and every StepResult."""

    def __init__(self, path: str, spec: SpecConfig = NGRAM, overlap: bool = False,
                 kv_capacity: int = 4096, chunk: int = 8192, max_running: int = 64,
                 decode_layout: str = "auto", grammars: bool = False, draft: str | None = None):
        model, tokenizer = load_reference(path)
        geometry = probe_geometry(model)
        states = max_running if geometry.state_shapes else 0
        window = max(geometry.cache_layout.windows, default=0)
        # a window pool is the padded layout's (in pages every layer is in the pool)
        windows = min(kv_capacity, 2 * (max_running * window + 4096)) \
            if window and decode_layout == "padded" else 0
        drafter = None
        if draft is not None:   # the draft model of `--speculative draft`
            from mlxd.worker_proc.draft_model import drafter_for
            drafter = drafter_for(load_reference(draft)[0], kv_capacity)
        self.runner = runner_for(model, KVPool(geometry, kv_capacity, 2 * states, windows,
                                                 page=DECODE_PAGE),
                                 decode_layout=decode_layout, overlap=overlap, drafter=drafter)
        if grammars:
            from mlxd.worker_proc.grammar import Grammars
            self.runner.grammars = Grammars.for_model(tokenizer, self.runner.vocab_size)
        self.scheduler = Scheduler(SchedulerLimits(
            kv_capacity=kv_capacity, max_context=4096, chunked_prefill_size=chunk,
            max_running_requests=max_running, state_slots=states, snapshot_slots=states,
            window_capacity=windows, window=window, decode_page=self.runner.decode_page,
            speculative=spec, verifies_drafts=self.runner.verifies_drafts,
            worker_overlaps=overlap, draft_model=draft is not None))
        self.out: dict[int, list[tuple]] = {}   # rid -> [(token, logprob, top)]
        self.final: dict = {}                    # rid -> its entry with a finish_reason
        self.results = []
        self.steps = []
        self.budgets = []   # per step: rid -> tokens left to the running requests

    @property
    def counters(self) -> dict:
        return self.scheduler.stats()["speculative"]

    def add(self, rid: int, ids: list[int], max_tokens: int, sampling=None, stop=()) -> None:
        self.out[rid] = []
        self.scheduler.add_request(TokenizedRequest(
            rid, list(ids), sampling or SamplingParams(), max_tokens, list(stop)))

    def step(self) -> bool:
        left = {rid: r.max_new_tokens - len(r.output_ids)
                for rid, r in self.scheduler.running.items()}
        step = self.scheduler.schedule()
        if step is None:
            return False
        self.steps.append(step)
        self.budgets.append(left)
        result = self.runner.run(step)
        self.results.append(result)
        self.scheduler.process_result(result)
        for entry in self.scheduler.take_outputs():
            assert entry.error is None, entry.error
            tops = entry.top_logprobs or [None] * len(entry.token_ids)
            self.out[entry.rid] += list(zip(entry.token_ids, entry.logprobs, tops))
            if entry.finish_reason:
                self.final[entry.rid] = entry
        self.scheduler.check_integrity()
        return True

    def run(self, arrivals: dict | None = None, max_steps: int = 5000) -> None:
        """Steps until idle; `arrivals[k]`: (rid, ids, max_tokens) added before step k."""
        arrivals = dict(arrivals or {})
        for k in range(max_steps):
            for args in arrivals.pop(k, []):
                self.add(*args)
            if not self.step() and not arrivals:
                self.runner.close()
                return
        raise AssertionError("the engine did not go idle")

    def tokens(self, rid: int) -> list[int]:
        return [t for t, _, _ in self.out[rid]]

    def runs_of(self, rid: int) -> list[int]:
        """The lengths of the row's runs, step by step (1 without a draft)."""
        return [r.stop - r.start for res in self.results for i, r in res.row_runs() if i == rid]

    def assert_idle_and_whole(self) -> None:
        s = self.scheduler
        assert not s.running and not s.has_work
        s.check_integrity()
        cached = len(s.kv.tree.all_slots()) if s.kv.tree else 0
        assert s.kv.allocator.num_unheld + cached == s.limits.kv_capacity


def assert_speculated(e: Engine, method: str = "ngram") -> None:
    c = e.counters
    assert c["method"] == method
    assert c["verifies"] > 0 and c["accepted_tokens"] > 0, c


def assert_matches_mlx_lm(path: str, e: Engine, requests: dict) -> None:
    """requests: rid -> (ids, max_tokens)."""
    wrong = []
    for rid, (ids, n) in requests.items():
        ref = reference_tokens(path, ids, n, ignore_eos=True)
        got = e.out[rid]
        if [t for t, _, _ in got] != [t for t, _ in ref] or \
                max(abs(a[1] - b[1]) for a, b in zip(got, ref)) >= 1e-3:
            wrong.append(rid)
    assert not wrong, f"rids differing from mlx_lm: {wrong}"


# ---- greedy: exact against mlx_lm ------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fixture", ["llama_model", "qwen3_model"])
def test_staggered_batch_with_duplicates_matches_mlx_lm(fixture, overlap, request):
    """Rows arriving at different steps, finishing at different lengths, second copies
    of prompts (prefix-cache hits) and a plain prompt beside the repetitive ones."""
    path = request.getfixturevalue(fixture)
    requests = {0: (repeated(0), 40), 1: (repeated(1, times=3, tail=3), 25),
                2: (encode(path, PROMPTS[3]), 30), 3: (repeated(0), 33),
                4: (repeated(2, block=8), 18), 5: (repeated(1, times=3, tail=3), 40)}
    arrivals = {0: [(0, *requests[0]), (2, *requests[2])], 3: [(1, *requests[1])],
                7: [(3, *requests[3]), (4, *requests[4])], 12: [(5, *requests[5])]}
    e = Engine(path, overlap=overlap)
    e.run(arrivals)
    assert_speculated(e)
    assert any(n > 1 for rid in requests for n in e.runs_of(rid))
    assert_matches_mlx_lm(path, e, requests)
    for rid, (_, n) in requests.items():
        assert e.final[rid].finish_reason == "length"
        assert e.final[rid].usage.completion_tokens == n
    assert e.final[3].usage.cached_tokens > 0
    e.assert_idle_and_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_matches_mlx_lm(overlap, llama_model):
    requests = {rid: (repeated(rid, tail=rid), 30) for rid in range(3)}
    e = Engine(llama_model, overlap=overlap, chunk=16)
    e.run({0: [(rid, *requests[rid]) for rid in requests]})
    assert_speculated(e)
    assert_matches_mlx_lm(llama_model, e, requests)


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_matches_mlx_lm(overlap, llama_model):
    """A pool too small for every row's output: rows are retracted and resumed, drafting
    before and after."""
    requests = {rid: (repeated(rid % 3, times=3, tail=rid), 48) for rid in range(6)}
    e = Engine(llama_model, overlap=overlap, kv_capacity=320, chunk=64)
    e.run({0: [(rid, *requests[rid]) for rid in requests]})
    assert e.scheduler.num_retractions > 0
    assert_speculated(e)
    assert_matches_mlx_lm(llama_model, e, requests)
    e.assert_idle_and_whole()


# ---- seeded: the tokens of speculation off ----------------------------------------

SEEDED = {
    "temperature": SamplingParams(temperature=1.0, seed=3, top_logprobs=3),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=5, top_logprobs=3),
    "top_k_min_p": SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=7,
                                  top_logprobs=3),
    "penalties": SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.3, top_logprobs=3),
    "logit_bias": SamplingParams(temperature=1.0, seed=11, bias_ids=[7, 42, 99],
                                 bias_values=[3.0, -5.0, 2.0], top_logprobs=3),
}


def run_seeded(path: str, spec: SpecConfig, overlap: bool, sampling) -> Engine:
    e = Engine(path, spec=spec, overlap=overlap)
    arrivals = {0: [(0, repeated(0), 60, sampling), (1, repeated(1, times=3), 60, sampling)],
                4: [(2, repeated(0, tail=2), 45, sampling)]}
    e.run(arrivals)
    return e


@pytest.mark.parametrize("name", list(SEEDED))
def test_seeded_sampling_gives_the_tokens_of_speculation_off(name, llama_model):
    sampling = SEEDED[name]
    off = run_seeded(llama_model, OFF, False, sampling)
    on = run_seeded(llama_model, NGRAM, name in ("temperature", "penalties"), sampling)
    assert off.counters["verifies"] == 0
    assert_speculated(on)
    for rid in off.out:
        assert on.tokens(rid) == off.tokens(rid), rid
        assert max(abs(a[1] - b[1]) for a, b in zip(on.out[rid], off.out[rid])) < 1e-4
        assert [a[2][0] for a in on.out[rid]] == [b[2][0] for b in off.out[rid]]
        assert on.final[rid].usage.completion_tokens == len(on.out[rid])


# ---- unseeded: the same distribution ---------------------------------------------

def looping_prompt(path: str, continued: int = 20) -> list[int]:
    """A repetitive prompt followed by the model's own greedy continuation, which
    settles into a loop: rows continuing it draft from their first tokens, and
    sampled rows often agree."""
    ids = repeated(0)
    return ids + [t for t, _ in reference_tokens(path, ids, continued, ignore_eos=True)]


def sample_continuations(path: str, spec: SpecConfig, seed: int, n: int = 2000,
                         batch: int = 50, draft: str | None = None) -> tuple[list[list[int]], dict]:
    rng = random.Random(seed)
    prompt = looping_prompt(path)
    e = Engine(path, spec=spec, max_running=batch, draft=draft)
    rid = 0
    while rid < n:
        for _ in range(min(batch, n - rid)):
            e.add(rid, prompt, 6, SamplingParams(temperature=1.0,
                                                 seed=rng.randrange(2**31)))
            rid += 1
        while e.step():
            pass
    e.runner.close()
    return [e.tokens(r) for r in range(n)], e.counters


def chi_square_p(a: list, b: list) -> float:
    """Two-sample chi-square test of homogeneity, categories with an expected count
    under 5 merged into one (dropped if that one is still too small)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    keys, other = [], [0, 0]
    for k in set(ca) | set(cb):
        total = ca[k] + cb[k]
        if min(total * na, total * nb) / (na + nb) >= 5:
            keys.append((ca[k], cb[k]))
        else:
            other[0] += ca[k]
            other[1] += cb[k]
    if min(sum(other) * na, sum(other) * nb) / (na + nb) >= 5:
        keys.append(tuple(other))
    assert len(keys) >= 2, "too few categories to test"
    stat = 0.0
    for x, y in keys:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return chi2_survival(stat, len(keys) - 1)


def chi2_survival(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with `df` degrees of freedom, by the
    Wilson-Hilferty normal approximation (close enough for a 0.001 threshold)."""
    import math

    if x <= 0:
        return 1.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_the_chi_square_survival_function_is_close_to_the_exact_one():
    # exact values of the chi-square survival function (df, x, P)
    for df, x, p in [(1, 3.841, 0.05), (5, 11.07, 0.05), (10, 23.21, 0.01),
                     (20, 45.31, 0.001), (3, 1.0, 0.8013)]:
        assert abs(chi2_survival(x, df) - p) < 0.25 * p + 0.002


def test_unseeded_sampling_keeps_its_distribution(llama_model):
    """Temperature 1, different seeds per request and per run: the token at position 4
    and the first three tokens are distributed alike with speculation on and off."""
    spec = SpecConfig("ngram", max_batch=64)
    on, counters = sample_continuations(llama_model, spec, seed=1)
    off, _ = sample_continuations(llama_model, OFF, seed=2)
    assert counters["verifies"] > 0 and counters["accepted_tokens"] > 0, counters
    assert chi_square_p([t[4] for t in on], [t[4] for t in off]) > 0.001
    assert chi_square_p([tuple(t[:3]) for t in on], [tuple(t[:3]) for t in off]) > 0.001


# ---- stops and lengths inside a run ------------------------------------------------

def first_stop_inside_a_run(e: Engine, rid: int) -> int | None:
    """A position inside one of the row's runs (not its run's last) whose token occurs
    nowhere earlier in the output."""
    tokens, at = e.tokens(rid), 0
    for n in e.runs_of(rid):
        for p in range(at, at + n - 1):
            if tokens[p] not in tokens[:p]:
                return p
        at += n
    return None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_token_inside_a_run_ends_the_row_there(overlap, llama_model):
    prompts = {0: looping_prompt(llama_model, 20), 1: looping_prompt(llama_model, 30),
               2: repeated(1), 3: repeated(2)}
    probe = Engine(llama_model, overlap=overlap)
    probe.run({0: [(rid, ids, 40) for rid, ids in prompts.items()]})
    assert_speculated(probe)
    stops = {rid: first_stop_inside_a_run(probe, rid) for rid in prompts}
    stops = {rid: p for rid, p in stops.items() if p is not None}
    assert stops, "no run with a new token before its end"
    e = Engine(llama_model, overlap=overlap)
    for rid, ids in prompts.items():
        stop = [probe.tokens(rid)[stops[rid]]] if rid in stops else []
        e.add(rid, ids, 40, stop=stop)
    e.run()
    for rid in prompts:
        want = probe.tokens(rid)[:stops[rid] + 1] if rid in stops else probe.tokens(rid)
        assert e.tokens(rid) == want, rid
        assert e.final[rid].finish_reason == ("stop" if rid in stops else "length")
        assert e.final[rid].usage.completion_tokens == len(want)
        assert e.final[rid].usage.accepted_tokens <= len(want) - 1
    # the stopping step's run went past the stop: the scheduler cut it
    rid = next(iter(stops))
    assert sum(e.runs_of(rid)) > len(e.tokens(rid))
    e.assert_idle_and_whole()


def test_max_tokens_inside_a_run_ends_the_row_there(llama_model):
    """Each row's budget ends one token into a run the unbounded row got: the draft is
    capped by the budget, and the output is the unbounded one's prefix."""
    ids = repeated(3, times=4)
    probe = Engine(llama_model)
    probe.run({0: [(0, ids, 40)]})
    assert_speculated(probe)
    ends, at = [], 0
    for n in probe.runs_of(0):
        if n > 2:
            ends.append(at + 1)
        at += n
    assert ends, "no run of three tokens or more"
    e = Engine(llama_model)
    for rid, end in enumerate(ends[:4]):
        e.add(rid, ids, end + 1)
    e.run()
    for rid, end in enumerate(ends[:4]):
        assert e.tokens(rid) == probe.tokens(0)[:end + 1]
        assert e.final[rid].finish_reason == "length"
        assert e.final[rid].usage.completion_tokens == end + 1
    for step, left in zip(e.steps, e.budgets):   # no run past a row's budget
        for row in step.decodes:
            assert len(row.draft) + 1 <= left[row.rid]
    e.assert_idle_and_whole()


# ---- recurrent-state and sliding-window models --------------------------------------

@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("overlap", [False, True])
def test_recurrent_models_verify_drafts_exactly(arch, overlap, hybrid_model):
    """Recurrent layers see only each row's own draft positions (shorter drafts'
    padding masked out), and a verify whose rows drop positions replays the kept
    ones from the states before it: rows joining and leaving, tokens and logprobs
    as mlx_lm's, nothing leaked."""
    path = hybrid_model(arch)
    # prompts ending inside their repeated block: a draft from the first step on
    requests = {0: (repeated(0, times=5, tail=0) + repeated(0)[:3], 40),
                1: (repeated(1, block=9, times=4) + repeated(1, block=9)[:4], 30),
                2: (looping_prompt(path), 24),
                3: (repeated(2, block=5, times=6) + repeated(2, block=5)[:2], 20)}
    e = Engine(path, overlap=overlap)
    e.run({0: [(0, *requests[0])], 3: [(1, *requests[1])], 6: [(2, *requests[2])],
           9: [(3, *requests[3])]})
    if e.runner.decode_page == 0:   # no attention layer (mamba2): the padded layout
        assert not e.runner.verifies_drafts and e.counters["verifies"] == 0
        assert_matches_mlx_lm(path, e, requests)
        return
    partial = [n for res, step in zip(e.results, e.steps) if step.has_drafts
               for n, row in zip(res.runs, step.decodes) if n < 1 + len(row.draft)]
    # some verify dropped positions: its states were replayed (with overlap a row's
    # first decode is chained, without a draft: these prompts then draft only where
    # the model goes on copying them, as qwen3_next and falcon_h1 do)
    if not overlap or arch in ("qwen3_next", "falcon_h1"):
        assert partial
    assert_matches_mlx_lm(path, e, requests)
    e.assert_idle_and_whole()


def test_recurrent_models_sample_seeded_rows_as_without_drafts(hybrid_model):
    path = hybrid_model("qwen3_next")
    outs = []
    for spec in (OFF, NGRAM):
        e = Engine(path, spec=spec)
        e.run({0: [(rid, repeated(rid, times=5), 30,
                    SamplingParams(temperature=1.0, seed=rid, top_p=0.9))
                   for rid in range(3)]})
        outs.append(e)
    off, on = outs
    assert on.counters["verifies"] > 0
    for rid in range(3):
        assert on.tokens(rid) == off.tokens(rid), rid


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize("overlap", [False, True])
def test_sliding_window_models_verify_drafts_exactly(arch, overlap, hybrid_model):
    """Windowed layers (in the pool's pages, as every layer) attend their window of
    every draft position: tokens and logprobs as mlx_lm's, nothing leaked."""
    path = hybrid_model(arch)
    requests = {0: (repeated(0, times=5), 40), 1: (repeated(1, block=9, times=4), 30),
                2: (looping_prompt(path), 24)}
    e = Engine(path, overlap=overlap)
    assert e.runner.verifies_drafts and e.runner.decode_page
    e.run({0: [(0, *requests[0])], 3: [(1, *requests[1])], 6: [(2, *requests[2])]})
    assert e.counters["verifies"] > 0 and e.counters["accepted_tokens"] > 0
    assert_matches_mlx_lm(path, e, requests)
    e.assert_idle_and_whole()


# ---- refusals -----------------------------------------------------------------------

def drafting_step(e: Engine) -> Step:
    """Steps until the scheduler's next Step carries drafts; that Step, not run."""
    for _ in range(200):
        step = e.scheduler.schedule()
        assert step is not None
        if step.has_drafts:
            return step
        e.scheduler.process_result(e.runner.run(step))
        e.scheduler.take_outputs()
    raise AssertionError("no Step with drafts")


def assert_serves_after_reset(e: Engine, path: str) -> None:
    e.runner.reset()
    e.scheduler.reset_worker("reset")
    e.scheduler.take_outputs()
    ids = repeated(9)
    e.add(50, ids, 12)
    e.run()
    assert e.tokens(50) == [t for t, _ in reference_tokens(path, ids, 12, ignore_eos=True)]


def test_drafts_after_a_chained_step_are_refused(llama_model):
    e = Engine(llama_model, overlap=True)
    e.add(0, repeated(0), 40)
    step = drafting_step(e)
    # the Step before chained the next decode; one with drafts now cannot take it
    chained = Step(step.step_id, [DecodeRow(r.rid, r.slot) for r in step.decodes],
                   chain_next=True)
    e.runner.run(chained)
    assert e.runner.chained is not None
    bad = Step(step.step_id + 1, [replace(r, slot=r.slot + 1) for r in step.decodes])
    with pytest.raises(ValueError, match="chained"):
        e.runner.run(bad)
    assert_serves_after_reset(e, llama_model)


def test_a_draft_token_outside_the_vocabulary_is_refused(llama_model):
    e = Engine(llama_model)
    e.add(0, repeated(0), 40)
    step = drafting_step(e)
    rows = [replace(r, draft=r.draft[:-1] + [e.runner.vocab_size]) if r.draft else r
            for r in step.decodes]
    with pytest.raises(ValueError, match="draft token"):
        e.runner.run(Step(step.step_id, rows))
    assert_serves_after_reset(e, llama_model)


def test_drafts_to_a_padded_layout_worker_are_refused(llama_model):
    e = Engine(llama_model, decode_layout="padded")
    assert not e.runner.verifies_drafts
    e.add(0, repeated(0), 40)
    while not e.runner.batch.rids:
        e.step()
    step = e.scheduler.schedule()
    assert not step.has_drafts
    rid, slot = step.decodes[0].rid, step.decodes[0].slot
    with pytest.raises(ValueError, match="verifies none"):
        e.runner.run(Step(step.step_id, [DecodeRow(rid, slot, draft=[5, 6],
                                                   draft_slots=[slot + 1000, slot + 1001])]))
    assert_serves_after_reset(e, llama_model)


def test_misaligned_drafts_fail_the_row_check():
    with pytest.raises(ProtocolError, match="draft_slots"):
        DecodeRow(1, 10, draft=[5], draft_slots=[]).check()
    with pytest.raises(ProtocolError, match="draft_slots"):
        DecodeRow(1, 10, draft=[5, 6], draft_slots=[12]).check()
    DecodeRow(1, 10, draft=[5], draft_slots=[12]).check()
    DecodeRow(2, 11).check()


# ---- constrained rows ------------------------------------------------------------

LOOSE = {"type": "regex", "regex": r"[\s\S]*"}   # any text: drafts get accepted


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", ["loose", "regex", "json_schema"])
def test_constrained_rows_draft_and_give_the_tokens_of_speculation_off(kind, overlap,
                                                                       llama_model):
    """Constrained rows (greedy and seeded) draft beside free ones: each draft position
    is masked as the row's grammar is there, a draft is cut at a token the grammar
    refuses, and every row's tokens and logprobs are those of speculation off."""
    from mlxd.tokenizer_proc.constraints import ConstraintCompiler, parse_response_format
    from mlxd.tokenizer_proc.text import TextCodec
    from structured_support import response_formats

    fmt = LOOSE if kind == "loose" else response_formats()[kind]
    grammar = ConstraintCompiler(TextCodec(llama_model)).compile(parse_response_format(fmt))
    rows = {0: SamplingParams(temperature=1.0, seed=9),
            1: SamplingParams(grammar=grammar),
            2: SamplingParams(),
            3: SamplingParams(temperature=1.0, seed=4, grammar=grammar)}
    outs = []
    for spec in (OFF, NGRAM):
        e = Engine(llama_model, spec=spec, overlap=overlap, grammars=True)
        prompts = {0: repeated(0), 1: repeated(3), 2: repeated(0), 3: repeated(3)}
        e.run({0: [(rid, prompts[rid], 40, sampling) for rid, sampling in rows.items()]})
        e.assert_idle_and_whole()
        outs.append(e)
    off, on = outs
    assert_speculated(on)
    drafted = {r.rid for step in on.steps for r in step.decodes if r.draft}
    assert {1, 3} <= drafted   # the constrained rows drafted
    for rid in rows:
        assert on.tokens(rid) == off.tokens(rid), rid
        assert max(abs(a[1] - b[1]) for a, b in zip(on.out[rid], off.out[rid])) < 1e-3
    if kind == "loose":   # (the prompts were chosen for drafts this model accepts)
        assert on.final[1].usage.accepted_tokens > 0 and on.final[3].usage.accepted_tokens > 0
