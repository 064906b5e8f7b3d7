"""worker_proc/penalties.py: logit_bias, repetition / presence / frequency penalties and
min_tokens, checked against a plain numpy reference of their formulas (no model)."""

import mlx.core as mx
import numpy as np
import pytest

from mlxd.protocol import REPETITION_CONTEXT, SamplingParams
from mlxd.worker_proc import penalties
from mlxd.worker_proc.penalties import RowPenalties
from mlxd.worker_proc.sampling import RowState, sample
from penalty_reference import processed_logits as reference

VOCAB = 64


PARAMS = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=2.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.3),
    SamplingParams(bias_ids=[3, 7, 50], bias_values=[5.0, -100.0, 2.5]),
    SamplingParams(min_tokens=3),
    SamplingParams(bias_ids=[1], bias_values=[1.0], repetition_penalty=1.3,
                   presence_penalty=0.4, frequency_penalty=0.2, min_tokens=2),
]
STOP_IDS = [0, 5]


def random_logits(seed, rows):
    return np.random.default_rng(seed).normal(0, 3.0, size=(rows, VOCAB)).astype(np.float32)


@pytest.mark.parametrize("generated", [[], [4], [4, 9, 4, 4, 11], list(range(30)) * 2])
def test_apply_matches_the_reference_row_by_row(generated):
    rng = np.random.default_rng(len(generated))
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (1, 7, 25, 3, 40, 2, 9, 12)]
    states = [RowPenalties(p, VOCAB, prompt[-REPETITION_CONTEXT:], generated, STOP_IDS)
              for p, prompt in zip(PARAMS, prompts)]
    logits = random_logits(1, len(PARAMS))
    got = np.array(penalties.apply(mx.array(logits), states, [len(generated)] * len(PARAMS)))
    for i, (p, prompt) in enumerate(zip(PARAMS, prompts)):
        np.testing.assert_allclose(got[i], reference(logits[i], p, prompt, generated, STOP_IDS),
                                   rtol=1e-5, atol=1e-5, err_msg=str(p))


def test_the_repetition_penalty_scales_each_token_once_however_often_it_repeats():
    p = SamplingParams(repetition_penalty=2.0)
    state = RowPenalties(p, VOCAB, prompt_tail=[3, 3, 3, 4], output_ids=[3])
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 3], logits[0, 4] = 8.0, -8.0
    got = np.array(penalties.apply(mx.array(logits), [state], [1]))[0]
    assert got[3] == 4.0 and got[4] == -16.0 and np.count_nonzero(got) == 2


def test_the_repetition_window_forgets_tokens_older_than_its_context():
    p = SamplingParams(repetition_penalty=2.0)
    prompt = [9] + list(range(20, 20 + REPETITION_CONTEXT - 1))
    state = RowPenalties(p, VOCAB, prompt_tail=prompt[-REPETITION_CONTEXT:])
    logits = np.full((1, VOCAB), 4.0, dtype=np.float32)
    assert np.array(penalties.apply(mx.array(logits), [state], [0]))[0, 9] == 2.0
    state.record(mx.array([1]))   # token 9 leaves the window
    assert np.array(penalties.apply(mx.array(logits), [state], [1]))[0, 9] == 4.0


def greedy_run(logits_seq, params_rows, prompts, eval_each_step):
    """Greedy decode over given logits with sample(); returns each row's tokens."""
    rows = [RowState(p, seed=i, penalties=RowPenalties.for_prefill(_prefill(p, prompt), VOCAB))
            for i, (p, prompt) in enumerate(zip(params_rows, prompts))]
    outs = []
    for logits in logits_seq:
        out = sample(mx.array(logits), rows)
        if eval_each_step:
            mx.eval(out.tokens)
        outs.append(out)
    mx.eval([o.tokens for o in outs], [o.logprobs for o in outs])
    return rows, outs


def _prefill(p, prompt):
    from mlxd.protocol import PrefillInput
    return PrefillInput(1, [prompt[-1]], [], [1], p, prompt_tail=prompt[-REPETITION_CONTEXT:],
                        stop_token_ids=STOP_IDS if p.min_tokens else [])


@pytest.mark.parametrize("eval_each_step", [True, False], ids=["evaluated", "chained"])
def test_a_batch_of_penalised_and_plain_rows_decodes_as_the_reference(eval_each_step):
    params = PARAMS + [SamplingParams(), SamplingParams(top_logprobs=2)]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size=12).tolist() for _ in params]
    # a few strong favourites, so that the penalties change the choice often
    logits_seq = [random_logits(s, len(params)) + 6.0 * (np.arange(VOCAB) % 9 == 0)
                  for s in range(12)]
    _, outs = greedy_run(logits_seq, params, prompts, eval_each_step)
    for i, p in enumerate(params):
        generated = []
        for step, logits in enumerate(logits_seq):
            want = int(np.argmax(reference(logits[i], p, prompts[i], generated, STOP_IDS)))
            assert outs[step].tokens.tolist()[i] == want, (p, step)
            raw = logits[i] - np.log(np.exp(logits[i].astype(np.float64)).sum())
            assert outs[step].logprobs.tolist()[i] == pytest.approx(raw[want], abs=1e-4)
            generated.append(want)


def test_min_tokens_holds_back_the_stop_ids_then_lets_them_through():
    p = SamplingParams(min_tokens=3)
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 5], logits[0, 6] = 10.0, 5.0   # 5 is a stop id
    _, outs = greedy_run([logits] * 5, [p], [[1, 2]], eval_each_step=True)
    assert [o.tokens.tolist()[0] for o in outs] == [6, 6, 6, 5, 5]


def test_min_tokens_counts_the_tokens_generated_before_a_resume():
    p = SamplingParams(min_tokens=3)
    row = RowState(p, 0, generated=2,
                   penalties=RowPenalties(p, VOCAB, stop_ids=STOP_IDS))
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 0], logits[0, 6] = 10.0, 5.0
    assert sample(mx.array(logits), [row]).tokens.tolist() == [6]
    assert sample(mx.array(logits), [row]).tokens.tolist() == [0]


def test_a_resumed_row_counts_its_earlier_output():
    p = SamplingParams(presence_penalty=2.0, frequency_penalty=1.0)
    fresh = RowPenalties(p, VOCAB)
    for t in (4, 4, 9):
        fresh.record(mx.array([t]))
    resumed = RowPenalties(p, VOCAB, output_ids=[4, 4, 9])
    logits = mx.array(random_logits(3, 1))
    np.testing.assert_array_equal(np.array(penalties.apply(logits, [fresh], [3])),
                                  np.array(penalties.apply(logits, [resumed], [3])))


def test_sampled_rows_pick_from_the_processed_distribution():
    """A token biased to -100 is never drawn; one biased to +100 always is."""
    p_never = SamplingParams(temperature=1.0, seed=1, bias_ids=[2], bias_values=[-100.0])
    p_always = SamplingParams(temperature=1.0, seed=2, bias_ids=[40], bias_values=[100.0])
    logits = np.zeros((2, VOCAB), dtype=np.float32)
    logits[:, 2] = 20.0
    rows = [RowState(p, i, penalties=RowPenalties(p, VOCAB))
            for i, p in enumerate((p_never, p_always))]
    for _ in range(10):
        tokens = sample(mx.array(logits), rows).tokens.tolist()
        assert tokens[0] != 2 and tokens[1] == 40


def test_rows_without_processing_build_no_state():
    assert RowPenalties.for_prefill(_prefill(SamplingParams(temperature=0.5), [1, 2]),
                                    VOCAB) is None
