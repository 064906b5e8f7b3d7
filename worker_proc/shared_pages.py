"""Full decode pages that joining rows share instead of copying: a prefix that several
running requests start from (the radix cache's slots) is held in the pages once.

A page is known by the pool slots whose KV it holds, position for position: a row
joining with the same slots at the same page of its positions holds the same KV (the
slots are the pool's, and a slot holds one token's KV at one position of one prefix
from its write until the scheduler hands it out again). A joining row's full pages
are listed here under their slots; a later row whose pages name the same slots holds
those pages too instead of writing its own.

A slot the scheduler hands out again is written again (a prefill's new slots, a
decode's slot) before any row can join with it, so every write forgets the pages
listed under the slots it writes: a listed page always holds what its slots hold.
A page no row holds any more is forgotten with it.
"""

from collections.abc import Iterable, Sequence

import numpy as np


class SharedPages:
    def __init__(self, page: int):
        self.page = page
        self._by_slots: dict[bytes, int] = {}   # the slots' key -> page
        self._slots_of: dict[int, np.ndarray] = {}   # page -> its slots
        self._page_of_slot: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_slots)

    def _key(self, slots: Sequence[int]) -> bytes:
        return np.asarray(slots, np.int64).tobytes()

    def find(self, slots: Sequence[int]) -> int:
        """The page listed under these `page` slots, or 0."""
        return self._by_slots.get(self._key(slots), 0)

    def add(self, page: int, slots: Sequence[int]) -> None:
        """List `page`, which holds the KV of `slots` (one per position)."""
        ids = np.asarray(slots, np.int64)
        # a slot names one listed page: one listed under any of these is unlisted (a
        # prompt that parts from another's within a page; only sharing is lost)
        self.written(ids.tolist())
        self._by_slots[ids.tobytes()] = page
        self._slots_of[page] = ids
        self._page_of_slot.update(dict.fromkeys(ids.tolist(), page))

    def written(self, slots: Iterable[int]) -> None:
        """The pool's `slots` are written: the pages listed under them no longer
        hold what the slots will."""
        lookup = self._page_of_slot
        if not lookup:
            return
        for s in slots:
            page = lookup.get(s)
            if page:
                self.forget([page])

    def forget(self, pages: Iterable[int]) -> None:
        for page in pages:
            ids = self._slots_of.pop(page, None)
            if ids is None:
                continue
            del self._by_slots[ids.tobytes()]
            for s in ids.tolist():
                if self._page_of_slot.get(s) == page:
                    del self._page_of_slot[s]
