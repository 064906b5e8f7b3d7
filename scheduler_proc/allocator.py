"""KV slot allocator over the worker's pool, in pages.

The pool's slots come in pages of `page` consecutive ids: page q holds slots
q * page .. q * page + page - 1. Page 0 is never handed out (slot 0 is padding).
A page is handed out whole, and a sequence's position p always sits at offset
p mod page of its page: a run of positions of one request fills one page in
order, so the worker attends a request's KV where it lies, page by page, without
copying it anywhere (worker_proc/paged_batch.py).

A page's slots are freed one by one (the radix tree evicts tokens, a verify's
rejected drafts go back); the page itself is free again once none of its slots is
held. Until then its free slots are loose: only the request that took the page
writes there (its next positions, see `extend`; and the worker completes the window
of a cached prefix that ends inside a page by copying the prefix's positions into
the loose slots before the request's first one). With `page` 1 a page is a slot.
"""


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, capacity: int, page: int = 1):
        self.page = page
        self.pages = capacity // page
        self.capacity = self.pages * page
        self._free_pages = list(range(self.pages, 0, -1))   # pop() hands out low ids first
        self._page_free = bytearray([0]) + bytearray([1]) * self.pages
        self._held = [0] * (self.pages + 1)   # held slots per page
        self._window = [-1] * (self.pages + 1)   # the window a taken page was taken for
        rows = (self.pages + 1) * page
        self._is_free = bytearray([0]) * page + bytearray([1]) * (rows - page)

    @property
    def num_free(self) -> int:
        """Slots in free pages: what any request can be handed."""
        return len(self._free_pages) * self.page

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_unheld(self) -> int:
        """Slots holding nothing: those of free pages and the loose ones."""
        return sum(self._is_free)

    @property
    def num_loose(self) -> int:
        """Free slots of pages still held: only their page's taker writes there."""
        return self.num_unheld - self.num_free

    def loose_in(self, q: int) -> int:
        """Page `q`'s free slots while it is held (0 for a free page)."""
        return 0 if self._page_free[q] else self.page - self._held[q]

    def can_allocate(self, n: int) -> bool:
        return self.pages_for(n) <= len(self._free_pages)

    def pages_for(self, n: int) -> int:
        """Pages `n` positions of one request take at most."""
        return n if self.page == 1 else -(-n // self.page) + 1

    def allocate(self, n: int) -> list[int]:
        """`n` slots for positions 0..n-1 of a new run (fresh pages)."""
        return self.extend(0, n, 0)

    def extend(self, start: int, n: int, open_page: int) -> list[int]:
        """Slots for positions start .. start + n - 1 of a sequence, position p at
        offset p mod page: in `open_page` (the page the sequence took last, 0: none)
        while p stays within it and its slot is free, else in fresh pages."""
        page = self.page
        kept = self._kept(start, n, open_page)   # positions that stay in the open page
        need = self._fresh(start, n, kept)
        if need > len(self._free_pages):
            raise OutOfSlots(f"asked for {need} pages, {len(self._free_pages)} free")
        fresh = iter(self._free_pages[len(self._free_pages) - need:][::-1])
        del self._free_pages[len(self._free_pages) - need:]
        slots, q = [], open_page
        for i, p in enumerate(range(start, start + n)):
            if i >= kept and (i == kept or p % page == 0):
                q = next(fresh)
                self._page_free[q] = 0
                self._window[q] = p // page
            s = q * page + p % page
            self._is_free[s] = 0
            self._held[q] += 1
            slots.append(s)
        return slots

    def pages_needed(self, start: int, n: int, open_page: int) -> int:
        """Fresh pages positions start .. start + n - 1 take (`extend`)."""
        return self._fresh(start, n, self._kept(start, n, open_page))

    def _fresh(self, start: int, n: int, kept: int) -> int:
        """Fresh pages for positions start + kept .. start + n - 1."""
        first, rest = start + kept, n - kept
        return (first + rest - 1) // self.page - first // self.page + 1 if rest else 0

    def _kept(self, start: int, n: int, q: int) -> int:
        """How many of positions start.. go on in open page `q`: those before the
        page ends, while their slots are free."""
        page = self.page
        if page == 1 or not q or self._page_free[q] or self._window[q] != start // page:
            return 0
        kept, window = 0, start // page
        while kept < n and (start + kept) // page == window and \
                self._is_free[q * page + (start + kept) % page]:
            kept += 1
        return kept

    def take_page(self, window: int) -> int:
        """A free page for positions of `window` (position // page), held by its
        taker before it writes any slot (0: none free)."""
        if not self._free_pages:
            return 0
        q = self._free_pages.pop()
        self._page_free[q] = 0
        self._window[q] = window
        return q

    def free(self, slots: list[int]) -> None:
        """Return slots; a list with any slot that is not allocated changes nothing.
        A page none of whose slots is held any more is free again."""
        self.free_keep(slots, 0)

    def free_keep(self, slots: list[int], open_page: int) -> None:
        """`free`, but `open_page` stays with its taker even when emptied."""
        self._check(slots)
        for s in slots:
            self._release(s, open_page)

    def _check(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError("freeing the same slot twice")
        for s in slots:
            if not self.page <= s < len(self._is_free) or self._is_free[s]:
                raise ValueError(f"freeing slot {s} that is not allocated")

    def _release(self, s: int, keep: int = 0) -> None:
        q = s // self.page
        self._is_free[s] = 1
        self._held[q] -= 1
        if not self._held[q] and q != keep:
            self._give_page(q)

    def _give_page(self, q: int) -> None:
        self._page_free[q] = 1
        self._free_pages.append(q)

    def close_page(self, q: int) -> None:
        """Its taker lets go of page `q`: free now if none of its slots is held."""
        if q and not self._held[q] and not self._page_free[q]:
            self._give_page(q)

    def check_integrity(self) -> None:
        """Every page free or holding slots (or kept open), a free page's slots all
        free, slot 0's page never free."""
        page = self.page
        assert self._page_free[0] == 0 and not any(self._is_free[:page]), \
            "padding page 0 is marked free"
        assert len(set(self._free_pages)) == len(self._free_pages), \
            "a page is on the free list twice"
        assert all(self._page_free[q] for q in self._free_pages), "free list and bitmap disagree"
        assert sum(self._page_free) == len(self._free_pages), \
            "bitmap counts a page not on the free list"
        for q in range(1, self.pages + 1):
            row = self._is_free[q * page:(q + 1) * page]
            assert self._held[q] == page - sum(row), "a page's held count is off"
            if self._page_free[q]:
                assert self._held[q] == 0, "a free page holds slots"
