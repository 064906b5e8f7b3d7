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
    assert req.slot_ids == slots + new and req.prefix_len == 3 and req.behind == 0
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


# ---- in pages ------------------------------------------------------------------------

P = 8


def test_in_pages_duplicates_stay_the_requests_until_it_stops():
    """Two requests computing the same prompt: the second's are duplicates of what the
    tree holds. The worker reads them where they were written, so while it runs the
    request keeps them (private, its lock where it was); when it stops they go back
    and the tree keeps the first's."""
    kv = KVBook(8 * P, page=P)
    a, b = request(1, list(range(20))), request(2, list(range(20)))
    for req in (a, b):
        kv.attach_prefix(req, [], None)
        kv.extend(req, 20)
    assert kv.cache_progress(a)
    own_b = list(b.slot_ids)
    assert not kv.cache_progress(b)
    assert b.slot_ids == own_b and b.prefix_len == 0 and b.last_node is None
    kv.check_integrity([a, b])
    kv.release(b, keep=True)
    assert b.own_pages == {} and kv.tree.match_prefix(list(range(20)))[0] == a.slot_ids
    kv.check_integrity([a])
    kv.release(a, keep=True)
    kv.check_integrity([])
    assert kv.allocator.num_unheld + kv.tree.total_size == kv.capacity


def test_in_pages_a_prefix_is_cut_to_what_fits_the_pool_alone():
    """A cached prefix keeps its pages locked; with too many (a window split between
    two paths' pages), the request starts from a shorter one, page-aligned."""
    kv = KVBook(4 * P, page=P)
    prefix = [1 * P + i for i in range(P)] + [2 * P, 2 * P + 1] + \
        [3 * P + 2, 3 * P + 3]                    # 12 positions; the second window in 2 pages
    assert kv.fitting_prefix(prefix, 3 * P) == P  # 3 + 2 pages > 4: its first page only
    assert kv.fitting_prefix(prefix, 2 * P) == 12
    assert kv.fitting_prefix(prefix, 5 * P) == 0
    assert KVBook(64).fitting_prefix(prefix, 10**6) == 12   # slots: no pages to lock


def test_in_pages_a_request_goes_on_in_its_page_after_the_tree_takes_its_slots():
    """cache_progress moves a request's positions into the tree; its next positions
    still go in the page it took for their window (where a chained decode wrote)."""
    kv = KVBook(8 * P, page=P)
    req = request(1, list(range(12)))
    kv.attach_prefix(req, [], None)
    kv.extend(req, 12)
    kv.cache_progress(req)
    assert req.prefix_len == 12
    nxt = kv.extend_each([req])[0]
    assert nxt == req.slot_ids[11] + 1 and nxt % P == 12 % P
    kv.check_integrity([req])


def test_in_pages_the_next_page_is_booked_for_a_chained_decode():
    kv = KVBook(4 * P, use_tree=False, page=P)
    a, b = request(1, [1] * P), request(2, [1] * 3)
    for req, n in ((a, P), (b, 3)):
        kv.attach_prefix(req, [], None)
        kv.extend(req, n)
    booked = kv.book_next_pages([a, b])
    assert booked[0] and booked[1] == 0           # a's next position starts a page
    assert kv.extend_each([a, b])[0] == booked[0] * P
    kv.check_integrity([a, b])
    kv.extend(b, 2 * P - 4)                       # the pool's last page; b's next starts one
    assert kv.allocator.free_pages == 0 and kv.book_next_pages([a, b]) is None
    kv.release(a, keep=False)
    kv.release(b, keep=False)
    kv.check_integrity([])
    assert kv.allocator.free_pages == 4
