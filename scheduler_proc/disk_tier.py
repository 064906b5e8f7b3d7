"""The scheduler's side of the disk tier (--kv-disk): it decides, the worker reads
and writes the files (runtime/kv_disk.py).

It keeps a copy of the worker's index (the entry names the worker reported at start,
plus those it was asked to write since, minus those it reported gone). When the
radix tree takes new KV, `plan` lists the runs of whole blocks to write: from as
far as the index's entries reach along the prompt's chain (so entries chain), in pieces
of at most PIECE tokens, cut at multiples of PIECE (so a prompt that diverges later
still reuses the pieces before). When a request is admitted, `match` finds how far
the disk continues its cached prefix, to a point a prefill can resume from.

The front end's router learns what the disk holds from `events`: the prefix hashes
where entries a prefill can resume from end (each hash once, however many entries
end there), stored and removed as the index changes, reset when it is rebuilt. Only
entries a match can reach count: those chained from the root. An entry whose
predecessor is gone (evicted first, or its write skipped) is not told, and stops
being told when that happens, as are the entries after it.

What a prefill needs at its resume point beyond KV decides which entries are
resumable: every one for plain KV models; for a window-pool model the last piece
of a write whose `window + 1` preceding positions have window KV in the tree
(the entry carries it); for a recurrent model the last piece of a write that ends
where the tree holds a state snapshot (the entry carries it). Pure: no files, no
MLX, no sockets.
"""

from collections import Counter
from dataclasses import dataclass

from mlxd.protocol import DiskRun, Spill
from mlxd.runtime.kv_disk import DiskIndex, Listed, run_name
from mlxd.runtime.prefix_hash import PREFIX_BLOCK, ROOT_HASH

from .radix_cache import CacheEvents

PIECE = 1024   # most tokens of one entry (a multiple of PREFIX_BLOCK)


@dataclass(frozen=True)
class DiskHit:
    """Entries that continue a prompt past its cached prefix: `runs`, chained, the
    first starting at position `start`; a prefill may resume at `end`."""
    runs: list[DiskRun]
    start: int
    end: int


class DiskTier:
    def __init__(self, names: list[str], window: int = 0, needs_state: bool = False):
        self.index = DiskIndex()
        self.window = window
        self.needs_state = needs_state
        self.events = CacheEvents()   # resumable entries' end hashes (the router's)
        self._reachable: set[str] = set()      # entries chained from the root
        self._reached: Counter[int] = Counter()   # end hash -> reachable entries there
        self._ends: Counter[int] = Counter()      # end hash -> of those, the told ones
        self.events.dropped_all()
        for name in names:
            self._add(name)
        self._spills: list[Spill] = []
        self.hit_tokens = 0      # prompt tokens admitted as read from disk
        self.missed_tokens = 0   # of those, computed after all (a read missed)
        self.spilled_tokens = 0  # tokens asked to be written

    def stats(self) -> dict:
        return {"entries": len(self.index), "hit_tokens": self.hit_tokens,
                "missed_tokens": self.missed_tokens, "spilled_tokens": self.spilled_tokens}

    def forget(self, names: list[str]) -> None:
        """The worker no longer has these entries."""
        for name in names:
            if name in self._reachable:
                self._unreach(name)
            self.index.remove(name)

    def announce(self) -> None:
        """Make the next events describe every end anew (a front end (re)joined)."""
        self.events.dropped_all()
        self.events.stored(list(self._ends))

    def _add(self, name: str) -> None:
        if name in self.index or not self.index.add_name(name):
            return
        parent = self.index.get(name).parent
        if parent == ROOT_HASH or self._reached[parent]:
            self._reach(name)

    def _reach(self, name: str) -> None:
        """`name` is chained from the root now, and so are the entries after it."""
        todo = [name]
        while todo:
            name = todo.pop()
            self._reachable.add(name)
            listed = self.index.get(name)
            self._reached[listed.end] += 1
            if self._announced(listed):
                self._ends[listed.end] += 1
                if self._ends[listed.end] == 1:
                    self.events.stored([listed.end])
            if self._reached[listed.end] == 1:
                todo += [c for c in self.index.children.get(listed.end, ())
                         if c not in self._reachable]

    def _unreach(self, name: str) -> None:
        """`name` is gone (or cut off): it and the entries only it chained are not
        reachable any more."""
        todo = [name]
        while todo:
            name = todo.pop()
            self._reachable.discard(name)
            listed = self.index.get(name)
            self._reached[listed.end] -= 1
            if self._announced(listed):
                self._ends[listed.end] -= 1
                if not self._ends[listed.end]:
                    del self._ends[listed.end]
                    self.events.removed([listed.end])
            if not self._reached[listed.end]:
                del self._reached[listed.end]
                todo += [c for c in self.index.children.get(listed.end, ())
                         if c in self._reachable]

    def _announced(self, listed: Listed) -> bool:
        """A prefill can resume at the entry's end (so a router may count it)."""
        return listed.resumable or not (self.window or self.needs_state)

    def take_spills(self) -> list[Spill]:
        spills, self._spills = self._spills, []
        return spills

    # ---- writing ------------------------------------------------------------------

    def plan(self, tokens: list[int], slots: list[int], hashes: list[int],
             windows: list[int] = (), snapshot: int = 0) -> None:
        """The tree holds `tokens` at `slots`, `hashes` their block hashes (and, with a
        window pool, window slots `windows`; with a recurrent model, a state snapshot
        at their end): spill the whole blocks past what the disk already holds."""
        end = len(tokens) - len(tokens) % PREFIX_BLOCK
        assert len(hashes) == end // PREFIX_BLOCK
        start = sum(self.index.get(name).n_tokens for name in self.index.match(hashes))
        cuts = [start] + list(range(start - start % PIECE + PIECE, end, PIECE)) + [end]
        for a, b in zip(cuts, cuts[1:]):
            if b <= a:
                continue
            spill = self._spill(tokens, slots, hashes, a, b, windows,
                                snapshot if b == len(tokens) else 0, last=b == end)
            self._add(run_name(spill.run))
            self._spills.append(spill)
            self.spilled_tokens += b - a

    def _spill(self, tokens, slots, hashes, a: int, b: int, windows, snapshot: int,
               last: bool) -> Spill:
        parent = hashes[a // PREFIX_BLOCK - 1] if a else ROOT_HASH
        window_ids, resumable = [], True
        if self.window:
            tail = list(windows[max(0, b - self.window - 1):b])
            resumable = last and all(tail)
            window_ids = tail if resumable else []
        if self.needs_state:
            resumable = resumable and bool(snapshot)
            snapshot = snapshot if resumable else 0
        run = DiskRun(parent, hashes[b // PREFIX_BLOCK - 1], b - a, resumable)
        return Spill(run, tokens[a:b], slots[a:b], window_ids, snapshot)

    # ---- reading ------------------------------------------------------------------

    def match(self, hashes: list[int], cached: int, limit: int,
              cached_windows: list[int] = ()) -> DiskHit | None:
        """How far the disk continues a prompt whose block hashes are `hashes` past
        its `cached` prefix (whose window slots, with a window pool, are
        `cached_windows`): a hit ending at most at `limit` (the prompt's last token
        is always computed), or None."""
        if not self.index:
            return None
        runs = [self.index.get(name) for name in self.index.match(hashes)]
        ends, at = [], 0
        for listed in runs:
            at += listed.n_tokens
            ends.append(at)
        for k in range(len(runs) - 1, -1, -1):
            end = self._resume_point(runs[k], ends[k], limit)
            if end is None or end <= cached:
                continue
            if self.window and not self._windows_held(cached, end, cached_windows):
                continue
            first = next(i for i in range(k + 1) if ends[i] > cached)
            start = ends[first] - runs[first].n_tokens
            return DiskHit([DiskRun(r.parent, r.end, r.n_tokens, r.resumable)
                            for r in runs[first:k + 1]], start, end)
        return None

    def _resume_point(self, listed: Listed, end: int, limit: int) -> int | None:
        """Where a prefill can resume within an entry ending at `end` (None: nowhere
        up to `limit`)."""
        if not (self.window or self.needs_state):
            return min(end, limit)
        if not listed.resumable:
            return None
        if end <= limit:
            return end
        if self.window and not self.needs_state and end - 1 <= limit:
            return end - 1   # its window tail holds the window before end - 1 too
        return None

    def _windows_held(self, cached: int, end: int, cached_windows: list[int]) -> bool:
        """The window before `end` reaching into the cached prefix finds it held."""
        first = max(0, end - self.window)
        return first >= cached or all(cached_windows[first:cached])
