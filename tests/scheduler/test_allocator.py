"""scheduler_proc/allocator.py: the KV slot allocator."""

import random

import pytest

from mlxd.scheduler_proc.allocator import OutOfSlots, SlotAllocator


def test_fresh_allocator():
    a = SlotAllocator(8)
    assert (a.capacity, a.num_free, a.num_used) == (8, 8, 0)
    assert a.can_allocate(8) and not a.can_allocate(9)
    a.check_integrity()


def test_allocate_hands_out_distinct_slots_in_range_never_zero():
    a = SlotAllocator(10)
    slots = a.allocate(4) + a.allocate(1) + a.allocate(5)
    assert sorted(slots) == list(range(1, 11))
    assert (a.num_free, a.num_used) == (0, 10)
    a.check_integrity()


def test_allocate_zero_is_empty():
    a = SlotAllocator(3)
    assert a.allocate(0) == []
    assert a.num_free == 3
    a.check_integrity()


def test_out_of_slots():
    a = SlotAllocator(5)
    with pytest.raises(OutOfSlots):
        a.allocate(6)
    assert a.num_free == 5           # a failed allocation takes nothing
    a.allocate(3)
    assert not a.can_allocate(3)
    with pytest.raises(OutOfSlots):
        a.allocate(3)
    assert a.num_free == 2
    a.allocate(2)
    with pytest.raises(OutOfSlots):
        a.allocate(1)
    a.check_integrity()


def test_zero_capacity():
    a = SlotAllocator(0)
    assert a.num_free == 0 and a.allocate(0) == []
    with pytest.raises(OutOfSlots):
        a.allocate(1)
    a.check_integrity()


def test_free_returns_slots_for_reuse():
    a = SlotAllocator(4)
    first = a.allocate(4)
    a.free(first[1:3])
    assert a.num_free == 2
    again = a.allocate(2)
    assert sorted(again) == sorted(first[1:3])
    a.free(first[:1] + first[3:] + again)
    assert a.num_free == 4 and a.num_used == 0
    assert sorted(a.allocate(4)) == [1, 2, 3, 4]
    a.check_integrity()


def test_free_empty_list_is_a_no_op():
    a = SlotAllocator(4)
    a.allocate(2)
    a.free([])
    assert a.num_free == 2
    a.check_integrity()


def test_double_free_raises():
    a = SlotAllocator(4)
    slots = a.allocate(2)
    a.free(slots)
    with pytest.raises(ValueError):
        a.free(slots[:1])
    a.check_integrity()


def test_freeing_a_never_allocated_slot_raises():
    a = SlotAllocator(4)
    a.allocate(1)
    with pytest.raises(ValueError):
        a.free([4])               # in range but still free
    a.check_integrity()


@pytest.mark.parametrize("slot", [0, -1, 5, 100])
def test_freeing_unknown_slots_raises(slot):
    a = SlotAllocator(4)
    a.allocate(4)
    with pytest.raises(ValueError):
        a.free([slot])
    assert a.num_free == 0
    a.check_integrity()


@pytest.mark.parametrize("bad_list", [[1, 1], [1, 0], [1, 9], [1, 2, 1]],
                         ids=["repeat", "padding", "out-of-range", "repeat-later"])
def test_a_rejected_free_changes_nothing(bad_list):
    """A free() that raises must leave the allocator as it was (and consistent)."""
    a = SlotAllocator(4)
    a.allocate(4)
    with pytest.raises(ValueError):
        a.free(bad_list)
    a.check_integrity()
    assert a.num_free == 0
    assert a.allocate(0) == []
    a.free([1, 2])                # still allocated, so freeing them works
    assert a.num_free == 2
    a.check_integrity()


def test_check_integrity_catches_corruption():
    a = SlotAllocator(4)
    a.allocate(2)
    a._free_pages.append(a._free_pages[0])    # a page on the free list twice
    with pytest.raises(AssertionError):
        a.check_integrity()
    b = SlotAllocator(4)
    b._page_free[0] = 1           # padding page marked free
    with pytest.raises(AssertionError):
        b.check_integrity()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_against_a_set_model(seed):
    rng = random.Random(seed)
    capacity = rng.choice([1, 7, 64, 300])
    a = SlotAllocator(capacity)
    used: set[int] = set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(0, max(1, capacity // 4))
            if n <= capacity - len(used):
                slots = a.allocate(n)
                assert len(slots) == n == len(set(slots))
                assert all(1 <= s <= capacity for s in slots)
                assert not used & set(slots)
                used |= set(slots)
            else:
                with pytest.raises(OutOfSlots):
                    a.allocate(n)
        elif op < 0.85:
            if used:
                chosen = rng.sample(sorted(used), rng.randint(1, len(used)))
                a.free(chosen)
                used -= set(chosen)
        else:
            bad = rng.choice([0, capacity + 1, -3] + sorted(set(range(1, capacity + 1)) - used))
            if bad in used:
                continue
            with pytest.raises(ValueError):
                a.free([bad])
        assert a.num_free == capacity - len(used)
        assert a.num_used == len(used)
        assert a.can_allocate(capacity - len(used)) and not a.can_allocate(capacity - len(used) + 1)
        a.check_integrity()
    a.free(sorted(used))
    assert a.num_free == capacity
    assert sorted(a.allocate(capacity)) == list(range(1, capacity + 1))
    a.check_integrity()


# ---- pages ----------------------------------------------------------------------

P = 8


def test_positions_sit_at_their_offset_in_whole_pages():
    """Position p goes at offset p mod page; a run fills its pages in order and takes
    the lowest free pages, ascending."""
    a = SlotAllocator(4 * P, P)
    assert a.pages == 4 and a.capacity == 32
    slots = a.allocate(11)
    assert slots == list(range(P, P + 11))            # pages 1 and 2, offsets 0..7, 0..2
    assert [s % P for s in slots] == [p % P for p in range(11)]
    assert a.free_pages == 2 and a.num_free == 2 * P and a.num_loose == P - 3
    a.check_integrity()


def test_a_run_goes_on_in_the_page_it_took_for_that_window():
    a = SlotAllocator(4 * P, P)
    first = a.allocate(3)                            # page 1, offsets 0..2
    more = a.extend(3, 7, first[-1] // P)            # 3..7 in page 1, then 8, 9 in page 2
    assert more == [P + 3, P + 4, P + 5, P + 6, P + 7, 2 * P, 2 * P + 1]
    assert a.pages_needed(10, 1, 2) == 0 and a.pages_needed(16, 1, 2) == 1
    a.check_integrity()


def test_a_run_starting_mid_page_takes_a_fresh_page_at_that_offset():
    """A run whose window's page is not its own (a cached prefix ends inside it)
    starts a fresh page at the same offset; the page's slots before it stay loose."""
    a = SlotAllocator(4 * P, P)
    prefix = a.allocate(5)
    mine = a.extend(5, 2, 0)
    assert mine == [2 * P + 5, 2 * P + 6] and a.num_loose == (P - 5) + 5 + 1
    a.check_integrity()


def test_a_page_taken_for_one_window_is_not_continued_in_another():
    a = SlotAllocator(4 * P, P)
    first = a.extend(3, 2, 0)                        # page 1, window 0, offsets 3, 4
    later = a.extend(P + 1, 1, first[0] // P)        # window 1: not page 1 again
    assert later[0] // P != first[0] // P and later[0] % P == 1
    a.check_integrity()


def test_a_page_is_free_once_none_of_its_slots_is_held():
    a = SlotAllocator(2 * P, P)
    slots = a.allocate(P + 2)
    a.free(slots[:P - 1])
    assert a.free_pages == 0                          # page 1 still holds one slot
    a.free([slots[P - 1]])
    assert a.free_pages == 1
    a.free_keep(slots[P:], slots[P] // P)             # its taker goes on there next
    assert a.free_pages == 1 and a.num_unheld == 2 * P
    a.close_page(slots[P] // P)
    assert a.free_pages == 2
    a.check_integrity()


def test_a_booked_page_holds_no_slot_until_written():
    a = SlotAllocator(2 * P, P)
    q = a.take_page(3)
    assert q and a.free_pages == 1 and a.num_loose == P
    assert a.extend(3 * P, 2, q) == [q * P, q * P + 1]   # the chained decode's position
    a.check_integrity()
    assert SlotAllocator(0, P).take_page(0) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_runs_never_share_a_slot(seed):
    """Random sequences growing and shrinking: every slot held by one of them at its
    position's offset, pages free exactly when nothing holds them."""
    rng = random.Random(seed)
    a = SlotAllocator(40 * P, P)
    seqs: dict[int, dict] = {}
    for step in range(2000):
        rid = rng.randrange(12)
        s = seqs.setdefault(rid, {"slots": [], "own": {}})
        op = rng.random()
        if op < 0.6:
            n, start = rng.randrange(1, 20), len(s["slots"])
            if a.pages_needed(start, n, s["own"].get(start // P, 0)) > a.free_pages:
                continue
            got = a.extend(start, n, s["own"].get(start // P, 0))
            for p, slot in enumerate(got, start):
                assert slot % P == p % P
                s["own"][p // P] = slot // P
            s["slots"] += got
        elif op < 0.8 and s["slots"]:   # drop a tail (rejected drafts)
            cut = rng.randrange(len(s["slots"]))
            a.free_keep(s["slots"][cut:], s["own"].get((cut - 1) // P, 0) if cut else 0)
            del s["slots"][cut:]
            for w in [w for w in s["own"] if w * P >= cut]:
                a.close_page(s["own"].pop(w))
        else:   # the sequence ends
            a.free(s["slots"])
            for q in s["own"].values():
                a.close_page(q)
            del seqs[rid]
        held = [slot for s in seqs.values() for slot in s["slots"]]
        assert len(set(held)) == len(held)
        a.check_integrity()
