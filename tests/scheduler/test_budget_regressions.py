"""Regression tests for defects found in review: decode-width and memory budgets, and
the longest prompt the tokenizer and scheduler accept."""

import pytest

from mlxd.runtime.kv_layout import cache_width as round_up
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.tokenizer_proc.params import InvalidRequest
from mlxd.tokenizer_proc.validation import check_length
from scheduler_harness import Harness, make_request
from support import worker_limits


def _worker_decode_width(h: Harness) -> int:
    """Tokens the worker's padded decode caches span after the last step: rows x the
    longest row rounded up to 256 (the quantity `decode_cache_tokens` budgets)."""
    if not h.batch:
        return 0
    return len(h.batch) * round_up(max(len(h.ctx[rid]) for rid in h.batch))


def test_a_chunked_prefill_respects_the_decode_width_budget():
    """Two short requests decode; a third one with a 40-token prompt arrives. The
    decode caches may span 512 tokens = 2 rows of 256, so the third request must wait,
    chunked or not: joining would make the worker's caches span 3 x 256 tokens."""
    h = Harness(kv_capacity=4096, decode_cache_tokens=512, chunked_prefill_size=16)
    h.add(make_request(1, n=4, max_new=50), make_request(2, n=4, max_new=50))
    h.run_step()
    assert sorted(h.batch) == [1, 2]
    h.add(make_request(3, n=40, max_new=5))
    widths = []
    for _ in range(6):
        h.run_step()
        widths.append(_worker_decode_width(h))
    assert max(widths) <= h.s.decode_cache_tokens, (
        f"worker decode caches spanned {widths} tokens; budget {h.s.decode_cache_tokens}")
    assert h.s.num_retractions == 0


@pytest.mark.parametrize("n,max_tokens", [
    (1000, 1), (999, 1), (999, 2), (999, 3), (500, 501), (500, 502), (1, 1000),
    (1, 1001), (10, 10**6), (4095, 10**6), (4096, 1),
])
@pytest.mark.parametrize("max_context", [4096, 1200, 600])
def test_tokenizer_and_scheduler_agree_on_the_longest_request(n, max_tokens, max_context):
    """Both judge prompt + max_tokens (clamped to the context) against the 1000-slot
    pool and the context alike, so the client gets the documented
    ErrorReply(code="invalid_request"), never a late "error" chunk."""
    cap = 1000
    try:
        check_length(n, worker_limits(kv_capacity=cap, max_context=max_context), max_tokens)
        tokenizer_accepts = True
    except InvalidRequest:
        tokenizer_accepts = False
    s = Scheduler(SchedulerLimits(kv_capacity=cap, max_context=max_context))
    s.add_request(make_request(1, n=n, max_new=max_tokens))
    [rejected] = s.take_outputs() or [None]
    scheduler_accepts = rejected is None
    assert tokenizer_accepts == scheduler_accepts, (
        f"tokenizer accepts={tokenizer_accepts}, scheduler says: {rejected and rejected.error}")


@pytest.mark.parametrize("n,max_tokens,accepted", [
    (4, 997, True), (4, 998, False), (999, 1, True), (999, 2, True), (999, 3, False),
    (1000, 1, False),
])
def test_the_tokenizer_refuses_a_request_bigger_than_the_pool(n, max_tokens, accepted):
    """n prompt slots plus one per generated token but the last must fit 1000 slots."""
    limits = worker_limits(kv_capacity=1000, max_context=4096)
    if accepted:
        check_length(n, limits, max_tokens)
    else:
        with pytest.raises(InvalidRequest, match="KV cache holds 1000"):
            check_length(n, limits, max_tokens)


def test_the_tokenizer_clamps_max_tokens_to_the_context_before_the_pool_check():
    """A default max_tokens beyond the context is clamped first: 10 + 90 fits 1000."""
    check_length(10, worker_limits(kv_capacity=1000, max_context=100), 10**6)


def test_overlap_decode_caches_stay_within_the_width_budget(llama_model):
    """With overlap the worker appends the *next* decode position to its batched
    caches at the end of every step; the scheduler's width budget counts that
    position, so the padded caches never span more than decode_cache_tokens (in
    pages the rows hold no copy at all: there is no such cache)."""
    from mlxd.protocol import SamplingParams, TokenizedRequest
    from support import load_reference
    from mlxd.runtime.kv_layout import DECODE_PAGE
    from mlxd.worker_proc.kv_pool import KVPool
    from mlxd.worker_proc.model_runner import probe_geometry, runner_for

    model, _ = load_reference(llama_model)
    spans = {}
    for overlap in (False, True):
        runner = runner_for(model, KVPool(probe_geometry(model), 4096, page=DECODE_PAGE), overlap=overlap,
                             decode_layout="padded")
        s = Scheduler(SchedulerLimits(kv_capacity=4096, max_context=2048,
                                      decode_cache_tokens=512, decode_page=runner.decode_page))
        s.add_request(TokenizedRequest(1, [7] * 240, SamplingParams(), 40, []))
        spans[overlap] = []
        for i in range(40):
            if i == 2:
                s.add_request(TokenizedRequest(2, [9] * 5, SamplingParams(), 40, []))
            step = s.schedule()
            if step is None:
                break
            s.process_result(runner.run(step))
            s.take_outputs()
            runner.close()
            spans[overlap].append(runner.batch.cache_tokens)
    assert max(spans[False]) <= 512
    assert max(spans[True]) <= s.decode_cache_tokens, (
        f"with overlap the decode caches spanned up to {max(spans[True])} tokens "
        f"(budget {s.decode_cache_tokens})")
    assert max(spans[True]) > 0


def test_kv_budget_keeps_pool_plus_twice_the_decode_caches_within_memory():
    """memory.kv_budget: the pool C and the decode caches D (rounded up to 256) satisfy
    C + 2D <= the tokens left after weights and the activation reserve."""
    from mlxd.worker_proc.memory import ACTIVATION_RESERVE_BYTES, kv_budget

    bytes_per_token = 1000
    tokens = 100_000
    budget = kv_budget(tokens * bytes_per_token + ACTIVATION_RESERVE_BYTES, 0,
                       bytes_per_token, max_running=64, ceiling=10**9)
    used = budget.capacity + 2 * budget.decode_cache_tokens
    assert used <= tokens, f"C + 2D = {used} tokens > {tokens} available ({budget})"


def test_a_chunked_request_waiting_for_decode_width_is_not_starved_by_later_arrivals():
    """A chunked request's last chunk waits while its row would not fit the decode
    width; later arrivals must count its pending row, or a stream of short requests
    (one per step, keeping 2 rows decoding) starves it forever."""
    h = Harness(kv_capacity=4096, decode_cache_tokens=1024, chunked_prefill_size=16)
    h.add(make_request(1, n=4, max_new=4))
    h.run_step()
    h.add(make_request(2, n=300, max_new=5))
    rid = 3
    for _ in range(300):
        h.add(make_request(rid, n=4, max_new=3))
        rid += 1
        h.run_step()
    served_after = sum(1 for r in range(3, rid) if r in h.final)
    assert h.output(2), (
        f"rid 2 never got its first token in 300 steps (holding "
        f"{len(h.s.running[2].slot_ids)} slots, queue {len(h.s.waiting)}), while "
        f"{served_after} requests that arrived after it finished")
