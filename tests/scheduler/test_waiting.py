"""scheduler_proc/waiting.py on its own: the waiting queue's order over a real KVBook
and radix tree, no Scheduler."""

import pytest

from mlxd.protocol import SamplingParams, TokenizedRequest
from mlxd.scheduler_proc.kv_book import KVBook
from mlxd.scheduler_proc.request import Request, Status
from mlxd.scheduler_proc.waiting import (
    LPM_OVERTAKE_LIMIT, LPM_QUEUE_LIMIT, SHARED_PREFIX_WAIT, WaitingQueue,
)

BASE = list(range(1, 101))   # a 100-token prompt prefix


def request(rid: int, ids: list[int]) -> Request:
    return Request.from_message(TokenizedRequest(rid, ids, SamplingParams(), 8, []), 8)


def cache(kv: KVBook, tokens: list[int]) -> None:
    kv.tree.insert(tokens, kv.allocate(len(tokens)))


def queue_of(kv: KVBook, *prompts: list[int]) -> tuple[WaitingQueue, list[Request]]:
    queue = WaitingQueue(kv)
    reqs = [request(rid, ids) for rid, ids in enumerate(prompts, 1)]
    for req in reqs:
        queue.add(req)
    return queue, reqs


def rids(order) -> list[int]:
    return [req.rid for req, _ in order]


def admit(req: Request) -> None:
    req.status = Status.RUNNING


# ---- membership ----------------------------------------------------------------------

def test_add_numbers_arrivals_and_push_front_keeps_them():
    queue, (a, b, c) = queue_of(KVBook(64, use_tree=False), [5], [6], [7])
    assert [r.arrival for r in (a, b, c)] == [0, 1, 2]
    queue.remove(b)
    assert list(queue) == [a, c] and len(queue) == 2 and queue[1] is c
    queue.push_front(b)                         # retracted: first, with its old number
    assert list(queue) == [b, a, c] and b.arrival == 1
    assert queue.find(3) is c and queue.find(99) is None


# ---- order ---------------------------------------------------------------------------

def test_longest_cached_prefix_first():
    kv = KVBook(256)
    cache(kv, BASE[:40])
    queue, _ = queue_of(kv, [500, 501], BASE[:20] + [500], BASE[:40] + [500], BASE[:10] + [7])
    order = queue.order()
    assert rids(order) == [3, 2, 4, 1]
    assert [cached for _, cached in order] == [40, 20, 10, 0]


def test_equal_cached_prefixes_keep_queue_order():
    kv = KVBook(256)
    cache(kv, BASE[:30])
    queue, (a, b, c, d) = queue_of(kv, BASE[:30] + [7], [400], BASE[:30] + [8], [401])
    assert rids(queue.order()) == [1, 3, 2, 4]
    queue.remove(c)
    queue.push_front(c)                         # a retracted request heads its tie
    assert rids(queue.order()) == [3, 1, 2, 4]


def test_the_last_input_token_never_counts_as_cached():
    kv = KVBook(256)
    cache(kv, BASE[:10])
    queue, _ = queue_of(kv, BASE[:10])          # all cached: one token is still computed
    assert queue.order()[0][1] == 9


@pytest.mark.parametrize("extra,lpm", [(0, True), (1, False)])
def test_fcfs_for_queues_longer_than_the_limit(extra, lpm):
    kv = KVBook(4096)
    cache(kv, BASE[:20])
    prompts = [[1000 + i] for i in range(LPM_QUEUE_LIMIT - 1 + extra)] + [BASE[:20] + [7]]
    queue, reqs = queue_of(kv, *prompts)
    order = queue.order()
    if lpm:
        assert order[0] == (reqs[-1], 20)
    else:
        assert [req for req, _ in order] == reqs and {c for _, c in order} == {None}
        assert all(req.match_key == () for req in reqs)   # nothing was matched


def test_fcfs_without_a_tree():
    queue, reqs = queue_of(KVBook(64, use_tree=False), [9, 9], [8])
    assert queue.order() == [(reqs[0], None), (reqs[1], None)]


# ---- overtakes -----------------------------------------------------------------------

def test_each_admitted_later_arrival_counts_as_one_overtake():
    kv = KVBook(256)
    cache(kv, BASE[:20])
    queue, (a, b, c, d) = queue_of(kv, [400], BASE[:20] + [1], [401], BASE[:20] + [2])
    order = queue.order()
    assert rids(order) == [2, 4, 1, 3]
    admit(b)
    admit(d)
    queue.count_overtakes(order)
    assert (a.overtaken, c.overtaken) == (2, 1)   # c arrived before d only
    assert (b.overtaken, d.overtaken) == (0, 0)


def test_fcfs_order_counts_no_overtakes():
    queue, (a, b) = queue_of(KVBook(64, use_tree=False), [9], [8])
    order = queue.order()
    admit(b)                                    # even if a later one got in
    queue.count_overtakes(order)
    assert a.overtaken == 0


def test_a_request_overtaken_often_enough_goes_first_oldest_first():
    kv = KVBook(256)
    cache(kv, BASE[:50])
    queue, (a, b, c, d) = queue_of(kv, [400], [401], BASE[:50] + [1], [402])
    a.overtaken = LPM_OVERTAKE_LIMIT - 1
    b.overtaken = LPM_OVERTAKE_LIMIT
    d.overtaken = LPM_OVERTAKE_LIMIT + 5
    assert rids(queue.order()) == [2, 4, 3, 1]
    a.overtaken += 1
    assert rids(queue.order()) == [1, 2, 4, 3]


def test_overtakes_accumulate_to_the_limit_over_steps():
    kv = KVBook(4096)
    cache(kv, BASE[:20])
    queue, (old,) = queue_of(kv, [400])
    for i in range(LPM_OVERTAKE_LIMIT):
        hit = request(100 + i, BASE[:20] + [i])
        queue.add(hit)
        order = queue.order()
        assert order[0][0] is hit               # the hit is tried first...
        admit(hit)                              # ...and admitted
        queue.remove(hit)
        queue.count_overtakes(order)
    assert old.overtaken == LPM_OVERTAKE_LIMIT
    queue.add(request(999, BASE[:20] + [5]))
    assert queue.order()[0][0] is old


# ---- the defer rule --------------------------------------------------------------------

@pytest.mark.parametrize("cached,shared,wait", [
    (0, SHARED_PREFIX_WAIT - 1, False), (0, SHARED_PREFIX_WAIT, True),
    (40, 40 + SHARED_PREFIX_WAIT - 1, False), (40, 40 + SHARED_PREFIX_WAIT, True)])
def test_a_request_sharing_a_long_uncached_prefix_with_a_prefill_waits(cached, shared, wait):
    kv = KVBook(256)
    if cached:
        cache(kv, BASE[:cached])
    queue, (filling, req) = queue_of(kv, BASE[:shared] + [500, 501], BASE[:shared] + [600])
    queue.remove(filling)
    admit(filling)
    [(_, length)] = queue.order()
    assert length == cached
    assert queue.should_wait(req, length, [filling]) is wait
    assert queue.should_wait(req, None, [filling]) is wait   # computes the length itself
    assert not queue.should_wait(req, length, [])


def test_any_prefill_sharing_enough_defers_a_request():
    kv = KVBook(256)
    queue, (stranger, sharer, req) = queue_of(kv, [400, 401], BASE[:40] + [1], BASE[:40] + [2])
    assert not queue.should_wait(req, None, [stranger])
    assert queue.should_wait(req, None, [stranger, sharer])


def test_no_defer_without_a_tree():
    queue, (filling, req) = queue_of(KVBook(256, use_tree=False), BASE + [1], BASE + [2])
    assert not queue.should_wait(req, None, [filling])


# ---- cached lengths: recomputed only when the tree changes ----------------------------

class CountingKV(KVBook):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.matches = 0

    def match(self, tokens):
        self.matches += 1
        return super().match(tokens)


def test_cached_lengths_are_recomputed_only_when_the_tree_version_changes():
    kv = CountingKV(256)
    cache(kv, BASE[:10])
    queue, (req,) = queue_of(kv, BASE[:30])
    assert queue.cached_len(req) == 10 and kv.matches == 1
    queue.order()
    kv.tree.insert(BASE[:10], kv.tree.match_prefix(BASE[:10])[0])   # nothing new
    assert queue.cached_len(req) == 10 and kv.matches == 1
    cache(kv, BASE[:20])
    assert queue.cached_len(req) == 20 and kv.matches == 2
    kv.tree.evict(256)
    assert queue.cached_len(req) == 0 and kv.matches == 3


def test_a_new_length_is_matched_again():
    kv = CountingKV(256)
    cache(kv, BASE[:40])
    queue, (req,) = queue_of(kv, BASE[:20])
    assert queue.cached_len(req) == 19
    req.output_ids = BASE[20:30]                # retracted after 10 outputs
    assert queue.cached_len(req) == 29 and kv.matches == 2


def test_a_length_from_the_cache_still_marks_the_prefix_used():
    """Waiting requests keep their prefix recent in the LRU without a new match."""
    kv = CountingKV(256)
    a, b = BASE[:20], [500 + i for i in range(20)]
    cache(kv, a)
    cache(kv, b)
    queue, (req,) = queue_of(kv, a + [7])
    queue.cached_len(req)
    kv.match(b)                                 # b used after a's match
    queue.cached_len(req)                       # from the cache, but touches a
    assert kv.matches == 2
    kv.tree.evict(20)                           # the least recently used goes: b
    assert kv.match(a)[0] and not kv.match(b)[0]
