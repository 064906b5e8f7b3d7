"""State slots for recurrent-state models: booked by the scheduler like KV slots, one
per running request, carried across chunks, freed at finish and retraction; snapshot
slots tied to radix nodes, reused by requests extending a prefix, evicted LRU. The
harness checks that every prefill starts from a state holding exactly its prefix."""

import pytest

from mlxd.scheduler_proc.kv_book import KVBook
from mlxd.scheduler_proc.request import Request
from scheduler_harness import Harness, by_position, make_request, prompt_of


def test_chunks_carry_the_state_in_the_requests_slot():
    h = Harness(kv_capacity=256, state_slots=4, chunked_prefill_size=8)
    h.add(make_request(1, n=20, max_new=3))
    h.run_until_idle()
    chunks = h.prefills_of(1)
    assert [len(p.input_ids) for p in chunks] == [8, 8, 4]
    slot = chunks[0].state_slot
    assert slot and [(p.state_from, p.state_slot) for p in chunks] == [
        (0, slot), (slot, slot), (slot, 0)]
    assert len(h.output(1)) == 3
    assert h.s.stats()["free_state_slots"] == 4
    h.assert_idle()


def test_no_prefix_is_shared_without_its_state():
    h = Harness(kv_capacity=256, state_slots=4)   # no snapshot slots
    h.add(make_request(1, n=12, max_new=2))
    h.run_until_idle()
    h.add(make_request(2, prompt=prompt_of(1, 12) + [5], max_new=2))
    h.run_until_idle()
    [p] = h.prefills_of(2)
    assert p.prefix_slot_ids == [] and p.state_from == 0
    assert h.final[2].usage.cached_tokens == 0


def test_admission_waits_for_a_free_state_slot():
    h = Harness(kv_capacity=256, state_slots=2, max_running_requests=8)
    h.add(*(make_request(r, n=4, max_new=3) for r in range(1, 5)))
    step = h.run_step()
    assert len(step.prefills) == 2 and len(h.s.running) == 2
    slots = {h.s.running[p.rid].state_slot for p in step.prefills}
    assert slots == {1, 2}
    h.run_until_idle()
    assert all(len(h.output(r)) == 3 for r in range(1, 5))
    h.assert_idle()


def test_a_retracted_request_frees_its_state_and_resumes_from_scratch():
    h = Harness(kv_capacity=40, state_slots=4, decode_headroom=0)
    h.token_fn = by_position
    h.add(make_request(1, n=10, max_new=12), make_request(2, n=10, max_new=12))
    h.run_until_idle()
    assert h.s.num_retractions >= 1 and h.resumes
    for rid, n_generated, _ in h.resumes:
        resumed = [p for p in h.prefills_of(rid) if p.num_generated == n_generated][0]
        assert resumed.prefix_slot_ids == [] and resumed.state_from == 0
    for rid in (1, 2):
        assert h.output(rid) == [by_position(rid, 10 + i) for i in range(len(h.output(rid)))]
    h.assert_idle()
    assert h.s.stats()["free_state_slots"] == 4


def test_the_books_count_every_state_slot():
    book = KVBook(16, use_tree=False, state_slots=2)
    reqs = [Request(r, [1], None, 1, frozenset()) for r in range(3)]
    assert book.take_state(reqs[0]) and book.take_state(reqs[1])
    assert not book.take_state(reqs[2])
    book.check_integrity(reqs[:2])
    with pytest.raises(AssertionError):
        book.check_integrity(reqs[:1])   # a slot held by no running request is lost
    book.release(reqs[0], keep=False)
    assert reqs[0].state_slot == 0 and book.take_state(reqs[2])
    book.check_integrity(reqs[1:])


def test_a_prompt_extending_a_snapshotted_one_resumes_from_its_state():
    h = Harness(kv_capacity=256, state_slots=4, snapshot_slots=4)
    h.add(make_request(1, n=12, max_new=3))
    h.run_until_idle()
    assert h.s.stats()["snapshots"] == 1
    h.add(make_request(2, prompt=prompt_of(1, 12) + [5, 6, 7], max_new=2))
    h.run_until_idle()
    [p] = h.prefills_of(2)
    assert len(p.prefix_slot_ids) == 12 and p.state_from == h.prefills_of(1)[0].snapshot_slot
    assert h.final[2].usage.cached_tokens == 12
    h.assert_idle()


def test_chunk_boundaries_are_snapshotted():
    h = Harness(kv_capacity=256, state_slots=4, snapshot_slots=8, chunked_prefill_size=8)
    h.add(make_request(1, n=20, max_new=2))
    h.run_until_idle()
    assert h.s.stats()["snapshots"] == 3   # after 8, 16 and 20 tokens
    h.add(make_request(2, prompt=prompt_of(1, 12) + [5], max_new=2))
    h.run_until_idle()
    assert h.final[2].usage.cached_tokens == 8   # the deepest snapshot within the match


def test_snapshots_are_taken_back_least_recently_used_first():
    h = Harness(kv_capacity=256, state_slots=4, snapshot_slots=2)
    for rid in (1, 2, 3):
        h.add(make_request(rid, n=10, max_new=2))
        h.run_until_idle()
    assert h.s.stats()["snapshots"] == 2
    h.add(make_request(4, prompt=prompt_of(1, 10) + [5], max_new=2),
          make_request(5, prompt=prompt_of(3, 10) + [5], max_new=2))
    h.run_until_idle()
    assert h.final[4].usage.cached_tokens == 0    # rid 1's snapshot went to rid 3
    assert h.final[5].usage.cached_tokens == 10


def test_snapshots_go_with_their_evicted_nodes():
    h = Harness(kv_capacity=48, state_slots=4, snapshot_slots=8)
    for rid in range(1, 7):
        h.add(make_request(rid, n=12, max_new=2))
        h.run_until_idle()
    stats = h.s.stats()
    assert stats["snapshots"] < 6 and stats["snapshots"] == len(h.s.kv.tree.all_snapshots())
    h.assert_idle()


def test_a_retracted_request_resumes_from_its_prompt_snapshot():
    h = Harness(kv_capacity=40, state_slots=4, snapshot_slots=4, decode_headroom=0)
    h.token_fn = by_position
    h.add(make_request(1, n=10, max_new=12), make_request(2, n=10, max_new=12))
    h.run_until_idle()
    assert h.s.num_retractions >= 1 and h.resumes
    resumed = [p for rid, n, _ in h.resumes for p in h.prefills_of(rid) if p.num_generated == n]
    assert any(len(p.prefix_slot_ids) == 10 and p.state_from for p in resumed)
    for rid in (1, 2):
        assert h.output(rid) == [by_position(rid, 10 + i) for i in range(len(h.output(rid)))]
    h.assert_idle()
