"""worker_proc/sampling.py: batched greedy / seeded sampling with filters (MLX, no model)."""

import math
import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlxd.protocol import SamplingParams
from mlxd.tokenizer_proc.params import parse_params
from mlxd.worker_proc.sampling import RowState, sample, top_lists

VOCAB = 64


def random_logits(seed, rows=1, vocab=VOCAB, scale=3.0):
    rng = np.random.default_rng(seed)
    return rng.normal(0, scale, size=(rows, vocab)).astype(np.float32)


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def row(seed=0, **params):
    return RowState(SamplingParams(**params), seed)


def draw(logits, rows):
    """Sample once; return (tokens, logprobs) as Python lists."""
    out = sample(mx.array(np.asarray(logits, dtype=np.float32)), rows)
    mx.eval(out.tokens, out.logprobs)
    return out.tokens.tolist(), out.logprobs.tolist()


def draw_many(logits_row, params, seeds):
    """One draw for each seed, all in one batch: a row of `logits_row` per seed."""
    logits = np.tile(np.asarray(logits_row, dtype=np.float32), (len(seeds), 1))
    tokens, _ = draw(logits, [RowState(params, s) for s in seeds])
    return tokens


# ---- greedy --------------------------------------------------------------------------

def test_greedy_is_argmax_with_log_softmax_logprob():
    logits = random_logits(0, rows=5)
    tokens, logprobs = draw(logits, [row() for _ in range(5)])
    assert tokens == logits.argmax(axis=-1).tolist()
    expected = log_softmax(logits)[np.arange(5), tokens]
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)


def test_greedy_ignores_filters_and_seed():
    logits = random_logits(1, rows=3)
    rows = [row(seed=9, top_k=3, top_p=0.5), row(min_p=0.9), row(seed=1, top_logprobs=2)]
    for _ in range(3):
        tokens, _ = draw(logits, rows)
        assert tokens == logits.argmax(axis=-1).tolist()


def test_sampled_logprob_is_the_raw_log_softmax_of_the_chosen_token():
    logits = random_logits(2, rows=8, scale=1.0)
    rows = [row(seed=s, temperature=0.7, top_k=10) for s in range(8)]
    tokens, logprobs = draw(logits, rows)
    expected = log_softmax(logits)[np.arange(8), tokens]
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)


def test_generated_counter_advances():
    rows = [row(), row(seed=3, temperature=1.0)]
    for n in range(1, 4):
        draw(random_logits(n, rows=2), rows)
        assert [r.generated for r in rows] == [n, n]


def test_bfloat16_logits_are_accepted():
    logits = random_logits(3, rows=2)
    out = sample(mx.array(logits).astype(mx.bfloat16), [row(), row(seed=1, temperature=1.0)])
    mx.eval(out.tokens, out.logprobs)
    assert out.tokens.tolist()[0] == int(np.array(mx.array(logits).astype(mx.bfloat16)
                                                  .astype(mx.float32)).argmax(axis=-1)[0])
    assert all(math.isfinite(x) for x in out.logprobs.tolist())


# ---- seeds ---------------------------------------------------------------------------

def sequence(logits_row, params, seed, n, neighbours_for_step):
    """`n` tokens of one seeded row; at each step it sits among other rows."""
    target = RowState(params, seed)
    tokens = []
    for step in range(n):
        neighbours, position = neighbours_for_step(step)
        rows = neighbours[:position] + [target] + neighbours[position:]
        logits = random_logits(1000 + step, rows=len(rows))
        logits[position] = logits_row
        got, _ = draw(logits, rows)
        tokens.append(got[position])
    return tokens


NEIGHBOURS = [
    lambda step: ([], 0),
    lambda step: ([RowState(SamplingParams(), 0)], 1),
    lambda step: ([RowState(SamplingParams(temperature=1.3, seed=5), 5),
                   RowState(SamplingParams(), 0)], step % 3),
    lambda step: ([RowState(SamplingParams(temperature=0.5, top_k=3), 77 + step),
                   RowState(SamplingParams(temperature=1.0, top_p=0.3), 78),
                   RowState(SamplingParams(temperature=2.0, min_p=0.2), 79),
                   RowState(SamplingParams(top_logprobs=4), 0)], (step * 7) % 5),
    lambda step: ([RowState(SamplingParams(temperature=1.0), 1000 + i) for i in range(step % 6)],
                  step % (step % 6 + 1)),
]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.2, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05, top_logprobs=3),
], ids=["plain", "top_k", "top_p", "min_p"])
def test_seeded_row_is_independent_of_its_batch(params):
    logits_row = random_logits(5, scale=1.0)[0]
    runs = [sequence(logits_row, params, 1234, 24, n) for n in NEIGHBOURS]
    assert all(r == runs[0] for r in runs), runs
    assert len(set(runs[0])) > 3          # a flat distribution: it really samples


def test_same_seed_same_tokens_different_seeds_differ():
    logits_row = np.zeros(VOCAB, dtype=np.float32)         # uniform
    params = SamplingParams(temperature=1.0)

    def run(seed):
        r = RowState(params, seed)
        return [draw(logits_row[None], [r])[0][0] for _ in range(40)]

    assert run(7) == run(7)
    seqs = [run(s) for s in (7, 8, 9, 2**62 + 1)]
    for i in range(len(seqs)):
        for j in range(i + 1, len(seqs)):
            assert sum(a != b for a, b in zip(seqs[i], seqs[j])) > 30


def test_different_seeds_in_one_batch_differ():
    tokens = draw_many(np.zeros(VOCAB), SamplingParams(temperature=1.0), list(range(200)))
    assert len(set(tokens)) > VOCAB // 2


# ---- filters -------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=5.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=3.0, top_p=0.01),
    SamplingParams(temperature=1.0, min_p=0.999),
    SamplingParams(temperature=2.0, min_p=1.0),
    SamplingParams(temperature=1.0, top_k=1, top_p=0.5, min_p=0.5),
], ids=["top_k=1", "top_k=1-hot", "top_p-tiny", "top_p-0.01", "min_p-0.999", "min_p-1",
        "all"])
def test_filters_that_leave_only_the_argmax(params):
    for seed in range(4):
        logits_row = random_logits(seed, scale=1.0)[0]
        tokens = draw_many(logits_row, params, list(range(150)))
        assert set(tokens) == {int(logits_row.argmax())}


@pytest.mark.parametrize("params", [
    {"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1e-300, "top_p": 1e-300, "min_p": 1e-300},
    {"temperature": 2.0, "top_p": 5e-324, "top_k": 3},
])
def test_tiny_accepted_values_give_the_argmax(params):
    """Values that underflow float32 pass validation and still pick the argmax
    (not token 0 from an all -inf row)."""
    sampling = parse_params(params, VOCAB, 1).sampling
    for seed in range(3):
        logits_row = random_logits(seed, scale=1.0)[0]
        logits_row[0] = logits_row.min() - 1.0   # token 0 is never the answer
        tokens = draw_many(logits_row, sampling, list(range(20)))
        assert set(tokens) == {int(logits_row.argmax())}


def test_unfiltered_sampling_is_not_just_the_argmax():
    """The control for the filter tests: the same logits do spread without filters."""
    logits_row = random_logits(0, scale=1.0)[0]
    tokens = draw_many(logits_row, SamplingParams(temperature=1.0), list(range(150)))
    assert len(set(tokens)) > 10


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_only_yields_the_k_largest(k):
    logits_row = random_logits(10 + k, scale=0.5)[0]
    allowed = set(np.argsort(-logits_row)[:k].tolist())
    tokens = draw_many(logits_row, SamplingParams(temperature=2.0, top_k=k), list(range(600)))
    assert set(tokens) <= allowed
    assert len(set(tokens)) == k                     # and all of them do occur


def test_top_k_in_a_batch_with_other_k():
    logits_row = random_logits(4, scale=0.5)[0]
    order = np.argsort(-logits_row).tolist()
    rows, logits = [], []
    for seed in range(300):
        rows.append(RowState(SamplingParams(temperature=2.0, top_k=1 + seed % 4), seed))
        logits.append(logits_row)
    tokens, _ = draw(np.stack(logits), rows)
    for r, token in zip(rows, tokens):
        assert token in order[:r.params.top_k]


def test_top_p_keeps_the_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64)
    logits_row = np.log(probs).astype(np.float32)
    tokens = draw_many(logits_row, SamplingParams(temperature=1.0, top_p=0.7), list(range(800)))
    assert set(tokens) == {0, 1}                   # 0.5 < 0.7, so token 1 is needed too
    tokens = draw_many(logits_row, SamplingParams(temperature=1.0, top_p=0.5), list(range(800)))
    assert set(tokens) == {0}


def test_min_p_keeps_tokens_above_the_fraction_of_the_max():
    probs = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float64)
    logits_row = np.log(probs).astype(np.float32)
    tokens = draw_many(logits_row, SamplingParams(temperature=1.0, min_p=0.6), list(range(800)))
    assert set(tokens) == {0, 1}                   # 0.3 >= 0.6 * 0.4 > 0.2


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_follow_softmax(temperature):
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits_row = np.log(probs).astype(np.float32)
    n = 6000
    tokens = draw_many(logits_row, SamplingParams(temperature=temperature), list(range(n)))
    counts = Counter(tokens)
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    freqs = np.array([counts[i] / n for i in range(4)])
    np.testing.assert_allclose(freqs, expected, atol=0.025)


def test_temperature_frequencies_over_steps_of_one_row():
    """The per-step keys of one seed also give softmax frequencies."""
    probs = np.array([0.25, 0.05, 0.6, 0.1])
    logits_row = np.log(probs).astype(np.float32)[None]
    r = RowState(SamplingParams(temperature=1.0), 42)
    counts = Counter(draw(logits_row, [r])[0][0] for _ in range(2000))
    freqs = np.array([counts[i] / 2000 for i in range(4)])
    np.testing.assert_allclose(freqs, probs, atol=0.04)


# ---- top logprobs --------------------------------------------------------------------

def test_no_top_logprobs_unless_asked():
    out = sample(mx.array(random_logits(0, rows=2)), [row(), row(seed=1, temperature=1.0)])
    assert out.top_ids is None and out.top_logprobs is None


def test_top_logprobs_sorted_via_top_lists():
    logits = random_logits(6, rows=3)
    rows = [row(top_logprobs=5), row(seed=2, temperature=1.0, top_logprobs=1), row()]
    out = sample(mx.array(logits), rows)
    mx.eval(out.top_ids, out.top_logprobs)
    ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
    assert len(ids[0]) == 5                           # the batch's largest n
    expected = log_softmax(logits)
    for i, n in enumerate([5, 1]):
        top_ids, top_lps = top_lists(ids[i], lps[i], n)
        want = np.argsort(-expected[i])[:n].tolist()
        assert top_ids == want
        np.testing.assert_allclose(top_lps, expected[i][want], atol=1e-5)
        assert top_lps == sorted(top_lps, reverse=True)


def test_top_logprobs_larger_than_vocab():
    logits = random_logits(7, rows=1, vocab=4)
    out = sample(mx.array(logits), [row(top_logprobs=20)])
    mx.eval(out.top_ids, out.top_logprobs)
    top_ids, top_lps = top_lists(out.top_ids.tolist()[0], out.top_logprobs.tolist()[0], 20)
    assert top_ids == np.argsort(-logits[0]).tolist()


def test_top_lists():
    assert top_lists([3, 1, 2], [-2.0, -0.5, -1.0], 2) == [[1, 2], [-0.5, -1.0]]
    assert top_lists([3, 1, 2], [-2.0, -0.5, -1.0], 5) == [[1, 2, 3], [-0.5, -1.0, -2.0]]
    assert top_lists([], [], 3) == [[], []]
    rng = random.Random(0)
    ids = list(range(50))
    lps = [rng.uniform(-10, 0) for _ in ids]
    got_ids, got_lps = top_lists(ids, lps, 7)
    assert got_lps == sorted(lps, reverse=True)[:7]
    assert [lps[i] for i in got_ids] == got_lps
