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
