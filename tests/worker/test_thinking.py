"""Thinking budgets (worker_proc/thinking.py): a row's state over the tokens it keeps,
and the ModelRunner forcing the end marker at the budget, against mlx_lm forcing the
same tokens with a logits processor."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlxd.protocol import PrefillInput, SamplingParams
from mlxd.worker_proc.thinking import DONE, THINKING, ThinkBudget
from support import PROMPTS, encode, load_reference, reference_tokens
from test_model_runner import Driver

END = [7, 8, 9]   # an end marker of three tokens


def budget(n, opened=True, start=(), end=END) -> SamplingParams:
    return SamplingParams(thinking_budget=n, think_start_ids=list(start),
                          think_end_ids=list(end), think_opened=opened)


def forced_run(row: ThinkBudget, model_tokens: list[int]) -> list[int]:
    """The tokens a row keeps when the model would pick `model_tokens` in turn."""
    out, i = [], 0
    while row.live and i < len(model_tokens):
        token = row.next_forced()
        if token is None:
            token, i = model_tokens[i], i + 1
        row.advance(token)
        out.append(token)
    return out


def test_no_budget_no_state():
    assert ThinkBudget.of(SamplingParams()) is None
    assert ThinkBudget.of(SamplingParams(thinking_budget=4)) is None   # no marker: no thinking


def test_the_end_marker_is_forced_at_the_budget():
    row = ThinkBudget.of(budget(3))
    assert forced_run(row, [1, 2, 3, 4, 5]) == [1, 2, 3, 7, 8, 9]
    assert row.phase == DONE and row.next_forced() is None


def test_a_budget_of_zero_forces_the_first_token():
    assert forced_run(ThinkBudget.of(budget(0)), [1, 2]) == [7, 8, 9]


def test_the_model_ending_its_thinking_is_never_cut():
    row = ThinkBudget.of(budget(10))
    assert forced_run(row, [1, 7, 8, 9, 5, 6]) == [1, 7, 8, 9]
    assert row.phase == DONE


def test_an_end_marker_begun_at_the_budget_is_continued_not_repeated():
    row = ThinkBudget.of(budget(3))
    assert forced_run(row, [1, 7, 8, 4]) == [1, 7, 8, 9]


def test_a_reply_that_does_not_open_the_block_is_never_cut():
    row = ThinkBudget.of(budget(1, opened=False, start=[5, 6]))
    assert forced_run(row, [5, 2, 3, 4]) == [5, 2]   # 5 then 2: not the start marker
    assert row.phase == DONE and forced_run(row, [3, 4]) == []


def test_thinking_opened_by_the_model_is_counted_from_its_start_marker():
    row = ThinkBudget.of(budget(2, opened=False, start=[5, 6]))
    assert forced_run(row, [5, 6, 1, 2, 3]) == [5, 6, 1, 2, 7, 8, 9]


@pytest.mark.parametrize("cut", range(8))
def test_a_resumed_row_continues_where_it_was(cut):
    """After a retraction the worker rebuilds the state from the output so far."""
    params, model = budget(2, opened=False, start=[5, 6]), [5, 6, 1, 2, 3]
    whole = forced_run(ThinkBudget.of(params), model)
    assert whole == [5, 6, 1, 2, 7, 8, 9]   # the model's tokens, then the forced ones
    resumed = ThinkBudget.of(params, whole[:cut])
    assert whole[:cut] + forced_run(resumed, model[min(cut, 4):]) == whole


def reference_forced(path: str, ids: list[int], forced: dict[int, int], n: int):
    """mlx_lm's greedy generation with `forced` (output position -> token) forced by a
    logits processor: [(token, logprob)], the forced positions' logprobs None (mlx_lm
    reports the processed ones there)."""
    model, _ = load_reference(path)

    def force(tokens, logits):
        at = tokens.shape[-1] - len(ids)
        if at not in forced:
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == forced[at], 0.0, -mx.inf)[None]

    steps = generate_step(mx.array(ids), model, max_tokens=n, logits_processors=[force])
    return [(t, None if i in forced else lp[t].item())
            for i, (t, lp) in enumerate(steps)]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_runner_forces_the_marker_as_mlx_lm_would(llama_model, overlap):
    d = Driver(llama_model, overlap=overlap)
    prompts = [encode(llama_model, p) for p in PROMPTS[:3]]
    budgets = [2, 5, None]   # the third row has none: it decodes beside them unchanged
    for rid, ids in enumerate(prompts):
        params = budget(budgets[rid]) if budgets[rid] is not None else SamplingParams()
        d.step([PrefillInput(rid, ids, [], d.new_slots(rid, len(ids)), params, True)])
    for _ in range(12):
        d.step()
    for rid, ids in enumerate(prompts):
        got = d.out[rid][:12]
        if budgets[rid] is None:
            want = reference_tokens(llama_model, ids, 12, ignore_eos=True)
        else:
            n = budgets[rid]
            want = reference_forced(llama_model, ids, {n + i: t for i, t in enumerate(END)}, 12)
        assert [t for t, _ in got] == [t for t, _ in want], rid
        assert max(abs(a[1] - b[1]) for a, b in zip(got, want) if b[1] is not None) < 1e-3


def test_under_a_live_budget_the_runner_does_not_build_ahead(llama_model):
    d = Driver(llama_model, overlap=True)
    ids = encode(llama_model, PROMPTS[0])
    d.step([PrefillInput(0, ids, [], d.new_slots(0, len(ids)), budget(3), True)])
    assert not d.runner._builds_ahead and d.runner.batch.rows[0].thinking.phase == THINKING
    for _ in range(6):
        d.step()
    assert d.runner.batch.rows[0].thinking.phase == DONE and d.runner._builds_ahead
