"""scheduler_proc/kv_book.py: new private slots for a request's next tokens."""

from mlxd.protocol import SamplingParams, TokenizedRequest
from mlxd.scheduler_proc.kv_book import KVBook
from mlxd.scheduler_proc.request import Request


def request(rid: int, ids: list[int]) -> Request:
    return Request.from_message(TokenizedRequest(rid, ids, SamplingParams(), 8, []), 8)


def test_extend_appends_new_private_slots_after_a_cached_prefix():
    kv = KVBook(32)
    kv.tree.insert([1, 2, 3], kv.allocate(3))
    req = request(1, [1, 2, 3, 4, 5, 6])
    slots, node = kv.match(req.all_ids)
    kv.attach_prefix(req, slots, node)
    new = kv.extend(req, 3)
    assert len(new) == 3 and not set(new) & set(slots)
    assert req.slot_ids == slots + new and req.prefix_len == 3 and not req.prefilling
    assert kv.allocator.num_free == 32 - 6
    kv.check_integrity([req])                   # the new slots are the request's own
    assert kv.extend(req, 0) == [] and len(req.slot_ids) == 6


def test_extend_each_gives_every_request_one_slot_in_order():
    kv = KVBook(32, use_tree=False)
    reqs = [request(rid, [rid]) for rid in (1, 2, 3)]
    for req in reqs:
        kv.extend(req, 1)
    new = kv.extend_each(reqs)
    assert [req.slot_ids[-1] for req in reqs] == new and len(set(new)) == 3
    assert all(len(req.slot_ids) == 2 for req in reqs)
    kv.check_integrity(reqs)
    for req in reqs:
        kv.release(req, keep=False)
    assert kv.allocator.num_free == 32 and all(req.slot_ids == [] for req in reqs)
