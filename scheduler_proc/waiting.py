"""The waiting queue and the order its requests are tried in.

Longest cached prefix first (ties: arrival order), so requests that share a cached
prefix run while it is still cached; a request that later arrivals overtook
LPM_OVERTAKE_LIMIT times goes first (no request waits forever behind a stream of
cache hits); FCFS for queues longer than LPM_QUEUE_LIMIT, where matching every
request each step would cost too much.
"""

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from .kv_book import KVBook
from .radix_cache import common_prefix_len
from .request import Request, Status

LPM_QUEUE_LIMIT = 128      # longer waiting queues fall back to FCFS
LPM_OVERTAKE_LIMIT = 32    # a request overtaken this often by later arrivals goes first
SHARED_PREFIX_WAIT = 32    # defer a request that would soon reuse this many more tokens


class WaitingQueue:
    """Requests not running, front first. Reads the radix tree through `kv` for
    cached-prefix lengths; never changes what the tree holds (only its LRU order)."""

    def __init__(self, kv: KVBook):
        self._kv = kv
        self._queue: deque[Request] = deque()
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, i: int) -> Request:
        return self._queue[i]

    # ---- membership -------------------------------------------------------------

    def add(self, req: Request) -> None:
        """A new request: numbered in arrival order, queued at the back."""
        req.arrival = next(self._arrivals)
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        """A retracted request: first in FCFS order; it keeps its arrival number."""
        self._queue.appendleft(req)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def find(self, rid: int) -> Request | None:
        return next((req for req in self._queue if req.rid == rid), None)

    # ---- order ------------------------------------------------------------------

    def order(self) -> list[tuple[Request, int | None]]:
        """The requests in the order to try them, each with its cached prefix length;
        lengths are None when the order is FCFS (no tree, or a long queue)."""
        if not self._kv.tree or len(self._queue) > LPM_QUEUE_LIMIT:
            return [(req, None) for req in self._queue]
        ranked = [(req, self.cached_len(req)) for req in self._queue]
        return sorted(ranked, key=_rank)

    def cached_len(self, req: Request) -> int:
        """Length of the request's cached prefix; recomputed only after the tree
        changed, so a long waiting queue costs little per step. Either way the
        prefix counts as used now, so waiting requests keep theirs in the LRU."""
        key = (self._kv.tree.version, req.num_tokens)
        if req.match_key != key:
            slots, req.match_node = self._kv.match(req.all_ids[:-1])
            req.match_len, req.match_key = len(slots), key
        elif req.match_node is not None:
            self._kv.tree.touch(req.match_node)
        return req.match_len

    def should_wait(self, req: Request, cached: int | None, prefilling: list[Request]) -> bool:
        """Defer a request that shares a long prefix with one being prefilled right
        now: a step later that prefix is cached and need not be computed twice.
        `cached` is the length `order()` gave (None: not computed yet)."""
        if not self._kv.tree or not prefilling:
            return False
        if cached is None:
            cached = self.cached_len(req)
        ids = req.all_ids
        return any(common_prefix_len(ids, other.all_ids) - cached
                   >= SHARED_PREFIX_WAIT for other in prefilling)

    @staticmethod
    def count_overtakes(order: list[tuple[Request, int | None]]) -> None:
        """After admission from `order`: each request still waiting was overtaken by
        every admitted one that arrived after it. Only LPM order overtakes."""
        if not order or order[0][1] is None:
            return
        admitted = sorted(req.arrival for req, _ in order if req.status is not Status.WAITING)
        if not admitted:
            return
        for req, _ in order:
            if req.status is Status.WAITING:
                req.overtaken += len(admitted) - bisect.bisect_right(admitted, req.arrival)


def _rank(pair: tuple[Request, int]) -> tuple:
    req, cached = pair
    if req.overtaken >= LPM_OVERTAKE_LIMIT:   # waited long enough: oldest first
        return (0, req.arrival)
    return (1, -cached)
