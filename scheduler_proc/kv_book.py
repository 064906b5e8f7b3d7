"""KV bookkeeping: which slot holds what, and who owns it.

A slot is either free (allocator), cached in the radix tree (evictable, or
protected while a running request's prefix lock covers it), or private to one
running request (KV it computed that the tree does not hold yet). Invariant:
free + evictable + protected + private == capacity. A request's `slot_ids` are
written here only.

Models with recurrent layers also get state slots (the worker's state pool): a
working slot per running request, holding its state between prefill chunks, and
snapshot slots: the state at the end of a prefill (each chunk and the prompt),
tied to the tree node where that KV ends. A prefix is usable only with the state
it ends at, so `match` cuts a match back to the deepest node with a snapshot.
Invariant: free + held by a running request == working slots; free + in the tree
+ pending (written by a step, not yet in the tree) == snapshot slots.

Models with sliding-window layers get window slots too (the worker's window pool):
per token position like KV slots (`Request.window_ids`, parallel to `slot_ids`, 0
where none is held), but held only where some step may still read them: the
`window` positions before the first new token of any step (a chunk's or a resumed
request's prefix) and before every point the tree may reuse. A request's private
window slots older than that are freed as it advances, and new positions that are
already older get none (the worker does not store them). So a request holds about
`window` of them however long it runs, and the tree `window` per cached prefix end.
`match` cuts a match back to a length whose `window` preceding positions are held.
Invariant: free + in the tree + private to running requests == window capacity.

Pins (Anthropic's cache_control): once the tree holds a request's prefix up to a
pin's offset, the path is pinned for the pin's TTL (`take_pins`), so eviction takes
other KV first; at most `max_pinned` slots are pinned at once (a pin that would pass
it is refused and counted, the request runs as it would have).

With a disk tier (`disk`, disk_tier.py), every new KV the tree takes is also planned
for writing to disk (`cache_progress`).
"""

import time
from typing import Callable

from .allocator import SlotAllocator
from .disk_tier import DiskTier
from .radix_cache import Node, RadixCache
from .request import Request


class KVBook:
    def __init__(self, capacity: int, use_tree: bool = True, state_slots: int = 0,
                 snapshot_slots: int = 0, window_capacity: int = 0, window: int = 0,
                 max_pinned: int = -1, pin_ttl_scale: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, page: int = 1):
        """`max_pinned`: the most slots pins may hold (-1: a quarter of `capacity`);
        `pin_ttl_scale` multiplies every pin's TTL (tests shorten them); `page`: the
        pool's positions per page (allocator.py; the worker reads its rows' KV in
        place page by page, so a request's slots never move while it runs)."""
        self.page = page
        self.allocator = SlotAllocator(capacity, page)
        self.capacity = capacity = self.allocator.capacity
        # window slots: the largest sliding window of the model (0: no window pool)
        self.window = window if window_capacity else 0
        self.window_capacity = window_capacity if self.window else 0
        self.windows = SlotAllocator(self.window_capacity)
        self._holders: dict[int, Request] = {}   # requests between attach and release
        self._writers: dict[int, Request] = {}   # requests with pages taken (in pages)
        self.state_slots = state_slots
        self.snapshot_slots = snapshot_slots if use_tree else 0
        self._free_states = list(range(state_slots, 0, -1))
        # snapshot slots follow the working slots in the worker's state pool
        self._free_snapshots = list(range(state_slots + self.snapshot_slots, state_slots, -1))
        # Eviction walks the whole tree: free a batch at a time, not one slot per step.
        self.evict_batch = max(1, min(256, capacity // 64))
        self.tree = (RadixCache(self.allocator.free, self._free_snapshots.append,
                                self.windows.free, clock) if use_tree else None)
        self.max_pinned = (max_pinned if max_pinned >= 0 else capacity // 4) if use_tree else 0
        self.pin_ttl_scale = pin_ttl_scale
        self.pins_refused = 0   # pins not taken: they would pass max_pinned
        self.disk: DiskTier | None = None   # the disk tier (--kv-disk), set by the scheduler

    # ---- capacity ---------------------------------------------------------------

    @property
    def available(self) -> int:
        """Slots that can be had now: free, or evictable from the tree, with (in pages)
        the loose slots of pages no running request writes in (they come free with
        the tree's slots there; an estimate: make_room may still fall short)."""
        evictable = self.tree.evictable_size if self.tree else 0
        loose = self.allocator.num_loose
        if loose and evictable:
            open_pages = {q for r in self._writers.values() for q in r.own_pages.values()}
            loose -= sum(self.allocator.loose_in(q) for q in open_pages)
            evictable += max(0, loose)
        return self.allocator.num_free + evictable

    @property
    def available_windows(self) -> int:
        """Window slots that can be had now: free, or kept by the tree and read by
        no running request (each may read up to `window + 1` of the tree's)."""
        if not self.tree:
            return self.windows.num_free
        reading = sum(min(self.window + 1, r.prefix_len) for r in self._holders.values())
        return self.windows.num_free + max(0, self.tree.num_windows - reading)

    def window_need(self, n: int) -> int:
        """Window slots one request's next `n` tokens take at most."""
        return min(n, self.window + 1)

    def room(self, n: int, start: int = -1) -> int:
        """Free slots `n` positions of one request need, from position `start` (-1:
        anywhere): the pages they touch (allocator.py)."""
        page = self.page
        if page == 1 or not n:
            return n
        if start < 0:
            return self.allocator.pages_for(n) * page
        return ((start + n - 1) // page - start // page + 1) * page

    def can_have(self, n: int, windows: int = 0, slots: int = -1) -> bool:
        """Room for `n` positions of one request (or exactly `slots` free slots) and
        `windows` window slots can be had (evicting if need be)."""
        need = self.room(n) if slots < 0 else slots
        return self.available >= need and (
            not self.window or self.available_windows >= windows)

    def fitting_prefix(self, prefix: list[int], total: int) -> int:
        """The longest start of a cached prefix (slots `prefix`) with which a request
        holding `total` positions fits the pool by itself: the prefix keeps the pages
        of its slots locked (a window of it may be in two pages, where the tree's
        paths part inside one) beside the pages the request takes for the rest."""
        page = self.page
        if page == 1:
            return len(prefix)
        for n in [len(prefix)] + list(range(len(prefix) // page * page, -1, -page)):
            held = len({s // page for s in prefix[:n]})
            if held + (total - 1) // page - n // page + 1 <= self.allocator.pages:
                return n
        return 0

    def extend_room(self, req: Request, n: int) -> int:
        """Free slots the request's next `n` positions take (whole fresh pages)."""
        start = len(req.slot_ids)
        return self.page * self.allocator.pages_needed(
            start, n, req.own_pages.get(start // self.page, 0))

    def decode_room(self, reqs: list[Request]) -> int:
        """Free slots one more position of each of `reqs` needs: a page each whose
        next position starts a page."""
        return self.page * sum(1 for r in reqs if self._next_page(r))

    def _next_page(self, req: Request) -> bool:
        n = len(req.slot_ids)
        return self.page == 1 or n // self.page not in req.own_pages   # (booked: taken)

    def book_next_pages(self, reqs: list[Request]) -> list[int] | None:
        """Per request, the page its next position goes to where that position starts
        a page it has not taken yet (taken now, empty), else 0; None, taking none,
        when free pages are short (a chained decode writes there before the Step
        that books its slot)."""
        page = self.page
        need = [r for r in reqs if len(r.slot_ids) % page == 0
                and len(r.slot_ids) // page not in r.own_pages]
        if len(need) > self.allocator.free_pages:
            return None
        for r in need:
            r.own_pages[len(r.slot_ids) // page] = self.allocator.take_page(len(r.slot_ids) // page)
        booked = {id(r) for r in need}
        return [r.own_pages[len(r.slot_ids) // page] if id(r) in booked else 0 for r in reqs]

    def make_room(self, n: int, windows: int = 0, slots: int = -1) -> bool:
        """Ensure free slots for `n` positions of one request (or exactly `slots`
        free slots) and `windows` free window slots (with a window pool), evicting
        unlocked tree leaves if needed. A page is free once the tree lets go of
        every slot it holds there, so eviction goes on until enough are."""
        windows = windows if self.window else 0
        n = self.room(n) if slots < 0 else slots
        while self.page > 1 and n > self.allocator.num_free and self.tree and \
                self.tree.evict(max(n - self.allocator.num_free, self.evict_batch)):
            pass
        short = n - self.allocator.num_free
        short_windows = windows - self.windows.num_free
        if (short > 0 or short_windows > 0) and self.tree:
            self.tree.evict(max(short, self.evict_batch) if short > 0 else 0,
                            max(short_windows, self.evict_batch) if short_windows > 0 else 0)
            short_windows = windows - self.windows.num_free
            if short_windows > 0:   # then windows of locked nodes no request reads
                self.tree.drop_windows(short_windows, self._windows_read())
        return self.allocator.num_free >= n and self.windows.num_free >= windows

    def _windows_read(self) -> set[int]:
        """The window slots a running request's next step may read."""
        keep = self.window + 1
        return {w for r in self._holders.values()
                for w in r.window_ids[max(0, len(r.window_ids) - keep):] if w}

    def allocate(self, n: int) -> list[int]:
        """`n` free slots that belong to no request (call make_room first)."""
        return self.allocator.allocate(n)

    def _take(self, req: Request, n: int) -> list[int]:
        """Slots for the request's next `n` positions, in the pages it took for their
        windows where it has them (allocator.py); appended to its `slot_ids`."""
        page, start = self.page, len(req.slot_ids)
        slots = self.allocator.extend(start, n, req.own_pages.get(start // page, 0))
        if page > 1 and n:
            self._writers[req.rid] = req
            for p in range(start - start % page, start + n, page):
                req.own_pages[p // page] = slots[max(p, start) - start] // page
        req.slot_ids += slots
        return slots

    def extend(self, req: Request, n: int, window_keep: int = 0) -> list[int]:
        """`n` new private slots for the request's next `n` tokens, appended to its
        `slot_ids` (call make_room first). Returns them. With a window pool, window
        slots for the last `window_keep` of them (0: `window + 1`)."""
        if self.window:
            self._extend_windows(req, n, window_keep or self.window + 1)
        return self._take(req, n)

    def drop_tail(self, req: Request, keep: int) -> None:
        """The request keeps its first `keep` positions; the private slots (and window
        slots) of those after them (a draft's rejected tokens') go back."""
        cut = max(keep, req.prefix_len)
        tail = req.slot_ids[cut:]
        if not tail:
            return
        self.allocator.free_keep(tail, req.own_pages.get((cut - 1) // self.page, 0)
                                 if cut else 0)
        del req.slot_ids[cut:]
        for w in [w for w in req.own_pages if w * self.page >= cut and self.page > 1]:
            self.allocator.close_page(req.own_pages.pop(w))
        if self.window:
            self.windows.free([w for w in req.window_ids[cut:] if w])
            del req.window_ids[cut:]

    def extend_each(self, reqs: list[Request]) -> list[int]:
        """One new private slot for each request's next token (a decode step).
        Returns them in the order of `reqs`."""
        if self.window:
            for req in reqs:
                self._extend_windows(req, 1)
        if self.page == 1:
            slots = self.allocator.allocate(len(reqs))
            for req, slot in zip(reqs, slots):
                req.slot_ids.append(slot)
            return slots
        return [self._take(req, 1)[0] for req in reqs]

    # ---- window slots ---------------------------------------------------------------

    def _extend_windows(self, req: Request, n: int, fresh_keep: int = 0) -> None:
        """Window slots for the request's next `n` positions: only for those among the
        last `window + 1` of its new length (a point and the one before it stay
        extendable: a match stops one token short of a repeated prompt's end). Its
        private ones older than the `window + 1` before this step's first new position
        are freed: no step reads them again."""
        start, keep = len(req.window_ids), self.window + 1
        fresh = self.windows.allocate(min(n, fresh_keep or keep))
        req.window_ids += [0] * (n - len(fresh)) + fresh
        stale_end = start - keep
        begin = max(req.prefix_len, req.window_floor)
        if stale_end > begin:
            stale = [w for w in req.window_ids[begin:stale_end] if w]
            req.window_ids[begin:stale_end] = [0] * (stale_end - begin)
            self.windows.free(stale)
        req.window_floor = max(req.window_floor, stale_end)

    def windows_read(self, req: Request, start: int) -> list[int]:
        """The window ids of the request's first `start` positions as a step whose new
        tokens start there reads them: the `window + 1` before `start`, 0 for older
        ones (no query reaches them; their slots may be someone else's by now)."""
        keep = min(start, self.window + 1)
        return [0] * (start - keep) + req.window_ids[start - keep:start]

    def usable_prefix(self, windows: list[int]) -> int:
        """The longest length L <= len(windows) whose `window` preceding positions all
        have window KV (a prefix the worker can extend)."""
        end = len(windows)
        while end > 0:
            zeros = [i for i in range(max(0, end - self.window), end) if not windows[i]]
            if not zeros:
                return end
            end = zeros[-1]
        return 0

    # ---- state slots ----------------------------------------------------------------

    @property
    def needs_state(self) -> bool:
        """Requests need a state slot to run (a recurrent-state model)."""
        return self.state_slots > 0

    def take_state(self, req: Request) -> bool:
        """Give the request a state slot if it needs one; False when none is free."""
        if not self.needs_state or req.state_slot:
            return True
        if not self._free_states:
            return False
        req.state_slot = self._free_states.pop()
        return True

    def take_snapshot(self, req: Request) -> int:
        """A snapshot slot for the state at the end of the request's next prefill (0
        when none can be had: the oldest unlocked snapshot is taken back first)."""
        if not self.snapshot_slots:
            return 0
        slot = self._free_snapshots.pop() if self._free_snapshots else \
            self.tree.take_lru_snapshot()
        req.pending_snapshot = slot
        return slot

    def _place_snapshot(self, req: Request, node: Node | None) -> None:
        """The prefill that wrote the request's pending snapshot is done: the node where
        its KV ends owns it, unless it has one already."""
        slot, req.pending_snapshot = req.pending_snapshot, 0
        if not slot:
            return
        if node is not None and node is not self.tree.root and not node.snapshot:
            self.tree.set_snapshot(node, slot)
        else:
            self._free_snapshots.append(slot)
    # ---- a request's prefix ------------------------------------------------------

    def match(self, tokens: list[int]) -> tuple[list[int], Node | None]:
        """The longest usable cached prefix of `tokens`: its slots and end node."""
        if not self.tree or not tokens:
            return [], None
        slots, node = self.tree.match_prefix(tokens)
        while True:
            if self.needs_state:   # back to the deepest node whose state is kept
                while node is not self.tree.root and not node.snapshot:
                    slots, node = slots[:len(slots) - len(node.value)], node.parent
            if not self.window:
                return slots, node
            usable = self.usable_prefix(self.tree.path_windows(node))
            if usable == len(slots):
                return slots, node
            slots, node = self.tree.match_prefix(tokens[:usable])   # ends on a node

    def attach_prefix(self, req: Request, slots: list[int], node: Node | None) -> None:
        """The request starts from a cached prefix: lock it, refer to its slots (and,
        for a recurrent model, to the snapshot of the state it ends at)."""
        if node is not None:
            self.tree.lock(node)
        req.last_node, req.prefix_len, req.slot_ids = node, len(slots), list(slots)
        req.state_from = node.snapshot if slots else 0
        if self.window:
            req.window_ids = self.tree.path_windows(node) if slots else []
            req.window_floor = 0
            self._holders[req.rid] = req

    def cache_progress(self, req: Request, final: bool = False) -> bool:
        """Put everything the request has computed into the tree and move its lock
        there, so other requests can share it while it runs (`final`: it stops).
        Duplicates it computed of what the tree holds meanwhile are freed, its slots
        then the tree's. In pages that waits until it stops (returns False, nothing
        changed): the worker reads its KV where it wrote it, and taking the tree's
        would lock more pages than its own."""
        if not self.tree:
            return False
        tokens = req.all_ids[:len(req.slot_ids)]
        if self.page > 1 and not final:
            held, _ = self.tree.match_prefix(tokens)
            if len(held) > req.prefix_len:
                self._place_snapshot(req, None)
                return False
        already = self.tree.insert(tokens, req.slot_ids, req.window_ids)
        self.allocator.free(req.slot_ids[req.prefix_len:already])   # duplicates
        if self.window:   # the tree takes the duplicates' window slots where it has none
            private = [0] * req.prefix_len + req.window_ids[req.prefix_len:already]
            self.windows.free(self.tree.adopt_windows(tokens, private, already))
        slots, node = self.tree.match_prefix(tokens)
        self._place_snapshot(req, node)
        if self.disk is not None and already < len(tokens):   # new KV: on disk too
            self.disk.plan(tokens, slots, self.tree.path_hashes(node),
                           self.tree.path_windows(node) if self.window else (), node.snapshot)
        self.tree.lock(node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len, req.slot_ids = node, len(slots), slots
        if self.window:
            req.window_ids = self.tree.path_windows(node)
        self.take_pins(req)
        return True

    def take_pins(self, req: Request) -> None:
        """Pin each of the request's prefixes that the tree holds now (each once): a
        pin that would take the pinned slots past `max_pinned` is refused. The
        request counts the tokens it computed (not those it read) that it pinned."""
        ready = [p for p in req.pins if p.offset <= req.prefix_len]
        if not ready:
            return
        req.pins = [p for p in req.pins if p.offset > req.prefix_len]
        for pin in ready:
            _, node = self.tree.match_prefix(req.all_ids[:pin.offset])   # ends on a node
            if self.tree.pinned_size + self.tree.pin_cost(node) > self.max_pinned:
                self.pins_refused += 1
                continue
            until = self.tree.now() + pin.ttl_seconds * self.pin_ttl_scale
            read = req.cached_tokens or 0
            req.pinned_tokens += sum(max(0, end - max(start, read))
                                     for start, end in self.tree.pin(node, until))

    def release(self, req: Request, keep: bool) -> None:
        """The request stops running: its KV goes to the tree (`keep`, when the KV
        is valid) or back to the allocator; its lock is dropped."""
        if keep and self.tree:
            self.cache_progress(req, final=True)
        else:
            self.allocator.free(req.slot_ids[req.prefix_len:])
            self.windows.free([w for w in req.window_ids[req.prefix_len:] if w])
        for page in req.own_pages.values():
            self.allocator.close_page(page)
        req.own_pages = {}
        self._writers.pop(req.rid, None)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len, req.slot_ids = None, 0, []
        req.window_ids, req.window_floor = [], 0
        self._holders.pop(req.rid, None)
        if req.state_slot:
            self._free_states.append(req.state_slot)
            req.state_slot = 0
        if req.pending_snapshot:   # its KV was not kept
            self._free_snapshots.append(req.pending_snapshot)
            req.pending_snapshot = 0
        req.state_from = 0

    def reset_tree(self) -> None:
        """Forget all cached KV (nothing may be running)."""
        if self.tree:
            self.tree.reset()

    # ---- reporting ----------------------------------------------------------------

    def stats(self, running: list[Request]) -> dict:
        tree = self.tree
        states = ({"state_slots": self.state_slots, "free_state_slots": len(self._free_states),
                   "snapshot_slots": self.snapshot_slots,
                   "snapshots": tree.num_snapshots if tree else 0}
                  if self.needs_state else {})
        windows = ({"window_slots": self.window_capacity,
                    "free_window_slots": self.windows.num_free,
                    "cached_window_slots": tree.num_windows if tree else 0}
                   if self.window else {})
        if tree:
            tree.expire()   # a pin past its time is not reported
        pins = {"pinned_slots": tree.pinned_size if tree else 0,
                "max_pinned_slots": self.max_pinned, "pins_refused": self.pins_refused,
                "pinned_evicted_slots": tree.pinned_evicted if tree else 0}
        return {**states, **windows, **pins,
            "capacity": self.capacity, "free_slots": self.allocator.num_unheld,
            "page": self.page, "free_pages": self.allocator.free_pages,
            "cached_slots": tree.total_size if tree else 0,
            "evictable_slots": tree.evictable_size if tree else 0,
            "used_slots": sum(len(r.slot_ids) - r.prefix_len for r in running)
                          + (tree.protected_size if tree else 0),
        }

    def check_integrity(self, running: list[Request]) -> None:
        if self.tree:
            self.tree.check_integrity()
        _check_owners("slot", self.allocator,
                      [s for r in running for s in r.slot_ids[r.prefix_len:]],
                      self.tree.all_slots() if self.tree else [])
        for r in running:
            assert r.prefix_len == 0 or r.last_node is not None
        self._check_windows(running)
        held = [r.state_slot for r in running if r.state_slot]
        assert len(held) + len(self._free_states) == self.state_slots, "a state slot is lost"
        assert len(set(held + self._free_states)) == self.state_slots, "a state slot is held twice"
        assert not self.needs_state or len(held) == len(running), "a request without state"
        snapshots = (self.tree.all_snapshots() if self.tree else []) + self._free_snapshots + [
            r.pending_snapshot for r in running if r.pending_snapshot]
        assert sorted(snapshots) == list(range(self.state_slots + 1,
                                               self.state_slots + self.snapshot_slots + 1)), \
            "a snapshot slot is lost or held twice"

    def _check_windows(self, running: list[Request]) -> None:
        for r in running:
            assert len(r.window_ids) == (len(r.slot_ids) if self.window else 0), \
                "window ids and slot ids differ in length"
        _check_owners("window slot", self.windows,
                      [w for r in running for w in r.window_ids[r.prefix_len:] if w],
                      self.tree.all_windows() if self.tree else [])


def _check_owners(kind: str, allocator: SlotAllocator, private: list[int],
                  cached: list[int]) -> None:
    """Every id of `allocator` is free, cached in the tree or private to one running
    request: exactly one of those, once."""
    allocator.check_integrity()
    assert len(set(private)) == len(private), f"a private {kind} is held twice"
    assert not set(private) & set(cached), f"a {kind} is both private and cached"
    total = allocator.num_free + allocator.num_loose + len(cached) + len(private)
    assert total == allocator.capacity, (
        f"{kind}s: free {allocator.num_free} + loose {allocator.num_loose} + cached "
        f"{len(cached)} + private {len(private)} != capacity {allocator.capacity}")
