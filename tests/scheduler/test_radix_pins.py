"""Pins (Anthropic's cache_control) in the radix tree and the scheduler's books: a
pinned path is evicted after every unpinned leaf, until its time ends; pinning again
extends it; splits keep it; the bound refuses a pin and counts it; a request reports
the tokens it computed and pinned. The clock is the test's."""

import random

from mlxd.protocol import Pin
from mlxd.scheduler_proc.allocator import SlotAllocator
from mlxd.scheduler_proc.radix_cache import RadixCache
from scheduler_harness import Harness, make_request


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_tree(capacity=64):
    allocator = SlotAllocator(capacity)
    clock = Clock()
    return RadixCache(allocator.free, clock=clock), allocator, clock


def cache(tree, allocator, tokens):
    """Insert `tokens` with fresh slots; returns the node they end at."""
    slots = allocator.allocate(len(tokens))
    already = tree.insert(tokens, slots)
    allocator.free(slots[:already])
    return tree.match_prefix(tokens)[1]


def cached(tree, tokens) -> int:
    node, i, _, _ = tree._walk(tokens)
    return i


# ---- the tree -----------------------------------------------------------------------

def test_a_pinned_path_outlives_unpinned_leaves_under_pressure():
    tree, allocator, clock = make_tree()
    pinned = cache(tree, allocator, [1, 2, 3, 4])       # the least recently used
    cache(tree, allocator, [10, 11, 12, 13])
    assert tree.pin(pinned, clock() + 300) == [(0, 4)]
    assert tree.pinned_size == 4
    assert tree.evict(4) == 4
    assert cached(tree, [1, 2, 3, 4]) == 4 and cached(tree, [10, 11, 12, 13]) == 0
    tree.check_integrity()


def test_pinned_leaves_go_last_when_nothing_else_is_left():
    tree, allocator, clock = make_tree()
    tree.pin(cache(tree, allocator, [1, 2, 3, 4]), clock() + 300)
    cache(tree, allocator, [10, 11, 12, 13])
    assert tree.evict(6) == 8
    assert tree.total_size == tree.pinned_size == 0 and tree.pinned_evicted == 4
    tree.check_integrity()


def test_a_pin_ends_at_its_time_and_a_later_pin_extends_it():
    tree, allocator, clock = make_tree()
    node = cache(tree, allocator, [1, 2, 3, 4])
    tree.pin(node, clock() + 300)
    clock.t += 200
    assert tree.pin(node, clock() + 300) == []          # refreshed: nothing new pinned
    clock.t += 200                                      # past the first time, not the second
    tree.expire()
    assert tree.pinned_size == 4
    clock.t += 100
    tree.expire()
    assert tree.pinned_size == 0 and node.pinned_until == 0
    cache(tree, allocator, [10, 11])
    tree.evict(4)                                       # LRU again: the old prefix goes
    assert cached(tree, [1, 2, 3, 4]) == 0 and cached(tree, [10, 11]) == 2
    tree.check_integrity()


def test_a_shorter_pin_does_not_shorten_a_longer_one():
    tree, allocator, clock = make_tree()
    node = cache(tree, allocator, [1, 2, 3, 4])
    tree.pin(node, clock() + 3600)
    short = tree.match_prefix([1, 2])[1]                # splits the pinned edge
    tree.pin(short, clock() + 300)
    clock.t += 301
    tree.expire()
    assert tree.pinned_size == 4
    tree.check_integrity()


def test_a_split_keeps_both_halves_pinned_and_both_expire():
    tree, allocator, clock = make_tree()
    tree.pin(cache(tree, allocator, [1, 2, 3, 4]), clock() + 300)
    cache(tree, allocator, [1, 2, 9])                    # splits the pinned edge after 2
    assert tree.pinned_size == 4
    tree.check_integrity()
    assert tree.evict(1) == 1                            # the unpinned [9] only
    assert cached(tree, [1, 2, 3, 4]) == 4
    clock.t += 301
    tree.expire()
    assert tree.pinned_size == 0
    tree.check_integrity()


def test_pin_reports_only_the_spans_it_newly_pins():
    tree, allocator, clock = make_tree()
    cache(tree, allocator, [1, 2, 3, 4, 5, 6])
    assert tree.pin(tree.match_prefix([1, 2])[1], clock() + 300) == [(0, 2)]
    assert tree.pin(tree.match_prefix([1, 2, 3, 4, 5])[1], clock() + 300) == [(2, 5)]
    assert tree.pin_cost(tree.match_prefix([1, 2, 3, 4, 5, 6])[1]) == 1
    assert tree.pinned_size == 5
    assert tree.evict(1) == 1                            # [6], past the pins
    assert cached(tree, [1, 2, 3, 4, 5, 6]) == 5
    tree.check_integrity()


def test_locked_nodes_stay_whatever_the_pins():
    tree, allocator, clock = make_tree()
    locked = cache(tree, allocator, [1, 2, 3])
    tree.lock(locked)
    tree.pin(cache(tree, allocator, [5, 6]), clock() + 300)
    assert tree.evict(10) == 2                           # the pinned leaf; not the locked one
    assert cached(tree, [1, 2, 3]) == 3
    tree.unlock(locked)
    tree.check_integrity()


def test_reset_drops_the_pins():
    tree, allocator, clock = make_tree()
    tree.pin(cache(tree, allocator, [1, 2, 3]), clock() + 300)
    tree.reset()
    assert tree.pinned_size == 0
    clock.t += 1000
    tree.expire()                                        # stale entries are ignored
    assert tree.pinned_size == 0
    tree.check_integrity()


def test_snapshots_are_taken_back_from_unpinned_nodes_first():
    tree, allocator, clock = make_tree()
    pinned = cache(tree, allocator, [1, 2])              # older
    other = cache(tree, allocator, [5, 6])
    tree.set_snapshot(pinned, 7)
    tree.set_snapshot(other, 8)
    tree.pin(pinned, clock() + 300)
    assert tree.take_lru_snapshot() == 8


def test_random_pins_evictions_and_expiry_keep_the_books():
    rng = random.Random(5)
    tree, allocator, clock = make_tree(capacity=400)
    for _ in range(600):
        op = rng.random()
        if op < 0.4 and allocator.num_free >= 12:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            cache(tree, allocator, tokens)
        elif op < 0.6 and tree.total_size:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            node = tree.match_prefix(tokens)[1]
            if node is not tree.root:
                before = tree.pinned_size
                spans = tree.pin(node, clock() + rng.choice([5, 50, 300]))
                assert tree.pinned_size == before + sum(e - s for s, e in spans)
        elif op < 0.8:
            pinned = tree.pinned_size
            freed = tree.evict(rng.randrange(1, 30))
            assert tree.pinned_size <= pinned
            assert freed <= tree.evictable_size + freed
        else:
            clock.t += rng.choice([1, 10, 100])
            tree.expire()
        tree.check_integrity()
        assert allocator.num_free + tree.total_size == 400


# ---- the scheduler's books ----------------------------------------------------------

def pinned_request(rid, prompt, *pins, max_new=2):
    msg = make_request(rid, max_new=max_new, prompt=prompt)
    msg.pin = [Pin(offset, ttl) for offset, ttl in pins]
    return msg


def clocked(**limits) -> tuple[Harness, Clock]:
    h = Harness(**limits)
    clock = Clock()
    h.s.kv.tree.now = clock
    return h, clock


def test_a_request_pins_its_prefix_once_prefilled_and_reports_it():
    h, _ = clocked(kv_capacity=64)
    prompt = list(range(100, 110))
    h.add(pinned_request(1, prompt, (6, 300)))
    h.run_until_idle()
    assert h.s.kv.tree.pinned_size == 6
    assert h.final[1].usage.pinned_tokens == 6 and h.final[1].usage.cached_tokens == 0
    h.add(pinned_request(2, prompt + [7], (6, 300)))     # the same breakpoint: a refresh
    h.run_until_idle()
    usage = h.final[2].usage
    assert usage.cached_tokens >= 6 and usage.pinned_tokens == 0
    assert h.s.stats()["pinned_slots"] == 6


def test_pinned_tokens_count_only_what_the_request_computed():
    h, _ = clocked(kv_capacity=64)
    prompt = list(range(100, 112))
    h.add(make_request(1, prompt=prompt[:6] + [1, 1]))  # caches the first 6, unpinned
    h.run_until_idle()
    h.add(pinned_request(2, prompt, (10, 300)))
    h.run_until_idle()
    usage = h.final[2].usage
    assert usage.cached_tokens == 6 and usage.pinned_tokens == 4   # 10 pinned, 6 read
    assert h.s.kv.tree.pinned_size == 10


def test_a_pin_past_the_bound_is_refused_and_the_request_runs():
    h, _ = clocked(kv_capacity=64, max_pinned_tokens=8)
    h.add(pinned_request(1, list(range(100, 110)), (6, 300)))
    h.add(pinned_request(2, list(range(200, 210)), (6, 300)))   # 6 + 6 > 8
    h.run_until_idle()
    assert [h.final[r].finish_reason for r in (1, 2)] == ["length", "length"]
    assert h.final[1].usage.pinned_tokens == 6 and h.final[2].usage.pinned_tokens == 0
    stats = h.s.stats()
    assert stats["pinned_slots"] == 6 and stats["pins_refused"] == 1
    assert stats["max_pinned_slots"] == 8


def test_the_bound_defaults_to_a_quarter_of_the_pool_and_zero_turns_pins_off():
    assert Harness(kv_capacity=64).s.stats()["max_pinned_slots"] == 16
    h, _ = clocked(kv_capacity=64, max_pinned_tokens=0)
    h.add(pinned_request(1, list(range(100, 110)), (6, 300)))
    h.run_until_idle()
    assert h.s.stats()["pins_refused"] == 1 and h.s.kv.tree.pinned_size == 0


def test_pressure_evicts_the_unpinned_prefix_and_keeps_the_pinned_one():
    h, clock = clocked(kv_capacity=48, max_pinned_tokens=16)
    pinned, plain = list(range(100, 112)), list(range(200, 212))
    h.add(pinned_request(1, pinned, (10, 300)))
    h.run_until_idle()
    h.add(make_request(2, prompt=plain, max_new=2))
    h.run_until_idle()
    h.add(make_request(3, prompt=list(range(300, 330)), max_new=2))   # needs room
    h.run_until_idle()
    h.add(make_request(4, prompt=pinned + [5], max_new=2),
          make_request(5, prompt=plain + [5], max_new=2))
    h.run_until_idle()
    assert h.final[4].usage.cached_tokens >= 10
    assert h.final[5].usage.cached_tokens == 0
    clock.t += 301                                       # the pin ends
    assert h.s.stats()["pinned_slots"] == 0
    h.s.check_integrity()


def test_a_pin_after_a_chunk_boundary_is_taken_when_its_chunk_is_cached():
    h, _ = clocked(kv_capacity=128, chunked_prefill_size=8)
    prompt = list(range(100, 130))
    h.add(pinned_request(1, prompt, (4, 300), (20, 3600)))
    h.schedule()
    h.answer(h.in_flight)                                # the first chunk: 8 tokens
    assert h.s.kv.tree.pinned_size == 4
    h.run_until_idle()
    assert h.s.kv.tree.pinned_size == 20 and h.final[1].usage.pinned_tokens == 20


def test_pins_expire_on_the_scale_the_limits_give():
    h = Harness(kv_capacity=64, pin_ttl_scale=0.01)
    clock = Clock()
    h.s.kv.tree.now = clock
    h.add(pinned_request(1, list(range(100, 110)), (6, 300)))
    h.run_until_idle()
    clock.t += 2.9
    assert h.s.stats()["pinned_slots"] == 6
    clock.t += 0.2
    assert h.s.stats()["pinned_slots"] == 0
