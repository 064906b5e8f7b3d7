"""Window slots for sliding-window models: booked per position like KV slots, held
only for the `window + 1` positions before a point some step or the tree may read,
freed as a request advances; a match is cut back to a point whose window is held.
The harness models the window pool and checks every prefill's window read-back."""

import random

import pytest

from mlxd.protocol import SamplingParams
from mlxd.scheduler_proc.kv_book import KVBook
from mlxd.scheduler_proc.request import Request
from scheduler_harness import Harness, by_position, make_request, prompt_of

W = 4   # the model's largest sliding window in these tests


def windowed(**limits) -> Harness:
    limits.setdefault("kv_capacity", 512)
    limits.setdefault("window_capacity", 128)
    return Harness(window=W, **limits)


def held(req) -> int:
    return sum(1 for w in req.window_ids[req.prefix_len:] if w)


def test_a_long_request_holds_a_window_not_its_length():
    h = windowed(chunked_prefill_size=8)
    h.add(make_request(1, n=30, max_new=40))
    most = 0
    while h.s.has_work:
        h.run_step()
        most = max([most] + [held(r) for r in h.s.running.values()])
    assert len(h.output(1)) == 40
    assert 0 < most <= 2 * (W + 1)
    chunks = h.prefills_of(1)
    assert [len(p.input_ids) for p in chunks] == [8, 8, 8, 6]
    for p in chunks:   # only the last window + 1 new positions are stored
        assert p.new_window_ids[:len(p.input_ids) - (W + 1)] == [0] * (len(p.input_ids) - W - 1)
        assert all(p.new_window_ids[-(W + 1):])
    h.assert_idle()
    # the tree keeps window + 1 per point it may extend: 4 chunk ends, and the finish
    # (whose last decode still held the one before its window: that step's prefix)
    stats = h.s.stats()
    assert stats["cached_window_slots"] == 4 * (W + 1) + W + 2
    assert stats["free_window_slots"] == 128 - stats["cached_window_slots"]
    assert stats["cached_slots"] == 30 + 39   # the last token is never an input


def test_a_prompt_extending_a_cached_one_reuses_its_window():
    h = windowed()
    h.add(make_request(1, n=20, max_new=3))
    h.run_until_idle()
    h.add(make_request(2, prompt=prompt_of(1, 20) + [60, 61, 62], max_new=3))
    h.run_until_idle()
    [p] = h.prefills_of(2)
    assert len(p.prefix_slot_ids) == 20 and p.input_ids == [60, 61, 62]
    assert h.final[2].usage.cached_tokens == 20
    h.assert_idle()


def test_a_repeated_prompt_reuses_all_but_its_last_token():
    h = windowed()
    h.add(make_request(1, n=20, max_new=2))
    h.run_until_idle()
    h.add(make_request(2, prompt=prompt_of(1, 20), max_new=2))
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 19


def test_a_match_is_cut_back_to_a_point_whose_window_is_held():
    h = windowed(chunked_prefill_size=8)
    h.add(make_request(1, n=40, max_new=2))
    h.run_until_idle()
    # shares 20 tokens: positions 15..19 have no window KV; 16 is a chunk end
    h.add(make_request(2, prompt=prompt_of(1, 20) + [5] * 10, max_new=2))
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 16
    h.assert_idle()


def test_without_windows_any_prefix_is_usable():
    h = Harness(kv_capacity=512, chunked_prefill_size=8)
    h.add(make_request(1, n=40, max_new=2))
    h.run_until_idle()
    h.add(make_request(2, prompt=prompt_of(1, 20) + [5] * 10, max_new=2))
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 20


def test_retracted_requests_resume_with_their_window_held():
    h = windowed(kv_capacity=40, decode_headroom=0)
    h.token_fn = by_position
    h.add(make_request(1, n=10, max_new=12), make_request(2, n=10, max_new=12))
    h.run_until_idle()
    assert h.s.num_retractions >= 1 and h.resumes
    for rid, n_generated, _ in h.resumes:   # the harness read each one's window back
        resumed = [p for p in h.prefills_of(rid) if p.num_generated == n_generated][0]
        assert len(resumed.prefix_slot_ids) >= 10
    for rid in (1, 2):
        assert h.output(rid) == [by_position(rid, 10 + i) for i in range(12)]
    h.assert_idle()


def test_a_released_request_can_be_extended_from_all_it_computed():
    book = KVBook(64, window_capacity=32, window=W)
    req = Request(1, prompt_of(1, 10), SamplingParams(), 20, frozenset())
    book.attach_prefix(req, [], None)
    book.extend(req, 10)
    book.cache_progress(req)
    for token in range(50, 57):
        req.output_ids.append(token)
        book.extend_each([req])
        book.check_integrity([req])
        assert held(req) <= W + 2
    book.release(req, keep=True)
    slots, node = book.match(req.all_ids)
    assert len(slots) == 17 and book.tree.path_windows(node)[-W:] != [0] * W
    book.check_integrity([])


def test_a_small_window_pool_evicts_cached_prefixes():
    h = windowed(window_capacity=3 * (W + 1) + 4, chunked_prefill_size=8)
    for rid in range(1, 7):
        h.add(make_request(rid, n=12, max_new=4))
        h.run_until_idle()
        assert len(h.output(rid)) == 4
    h.assert_idle()
    assert h.s.stats()["free_window_slots"] + h.s.stats()["cached_window_slots"] == 19


def test_chunks_without_the_tree_read_their_own_window():
    h = windowed(chunked_prefill_size=6, disable_radix_cache=True)
    h.add(make_request(1, n=20, max_new=5))
    h.run_until_idle()
    chunks = h.prefills_of(1)
    assert len(chunks) == 4 and all(p.prefix_window_ids[-W:] for p in chunks[1:])
    assert h.s.stats()["free_window_slots"] == 128
    h.assert_idle()


def test_windows_and_recurrent_state_together():
    h = windowed(state_slots=4, snapshot_slots=4, chunked_prefill_size=8)
    h.add(make_request(1, n=20, max_new=3))
    h.run_until_idle()
    h.add(make_request(2, prompt=prompt_of(1, 20) + [3, 4], max_new=3))
    h.run_until_idle()
    # a snapshot and a window at the prompt's end
    assert h.final[2].usage.cached_tokens == 20
    h.assert_idle()


def test_aborts_and_failures_free_every_window_slot():
    h = windowed(chunked_prefill_size=8)
    h.add(*(make_request(r, n=15, max_new=30) for r in range(1, 5)))
    for _ in range(5):
        h.run_step()
    h.abort(2)
    step = h.schedule()
    h.fail(step)
    h.run_until_idle()
    h.assert_idle()


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_keep_the_window_books(seed):
    rng = random.Random(seed)
    h = windowed(kv_capacity=rng.choice([64, 128, 512]),
                 window_capacity=rng.choice([24, 48, 200]),
                 chunked_prefill_size=rng.choice([3, 8, 32]),
                 max_prefill_tokens=rng.choice([8, 64]),
                 max_running_requests=rng.choice([2, 4, 8]),
                 disable_radix_cache=rng.random() < 0.2, decode_headroom=rng.choice([0, 4]))
    h.token_fn = by_position
    bases = [prompt_of(100 + i, 30) for i in range(3)]
    rid = 0
    for _ in range(40):
        roll = rng.random()
        if roll < 0.4:
            rid += 1
            base = rng.choice(bases)[:rng.randrange(1, 30)]
            prompt = base + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))]
            h.add(make_request(rid, prompt=prompt, max_new=rng.randrange(1, 16),
                               sampling=SamplingParams()))
        elif roll < 0.45 and h.s.running:
            h.abort(rng.choice(list(h.s.running)))
        else:
            h.run_step()
    h.run_until_idle()
    for r in range(1, rid + 1):
        out = h.output(r)
        assert out == [by_position(r, len(h.prompts[r]) + i) for i in range(len(out))]
    h.assert_idle()
