"""The radix prefix tree: token prefixes -> the KV slots that hold them.

Edges carry runs of token ids with their slot ids. Running requests lock the
path to the node their cached prefix ends at; unlocked leaves are evicted in
LRU order when the allocator runs short. Slots in the tree belong to the tree:
eviction hands them back through `free_slots`.

A node may also hold a `snapshot`: the state slot of a recurrent model's state at
the end of its edge. It belongs to the node (freed with it through `free_snapshot`,
or taken back earlier, LRU, by `take_lru_snapshot`).

Models with a window pool also cache, per token, its window slot (`Node.windows`,
parallel to `value`; 0 where the window-layer KV was not kept). Held window slots
belong to the tree like KV slots and go back through `free_windows` with their node,
or earlier, from any node, through `drop_windows` (the caller names the ones a
running request still reads).

A path may be pinned (cache_control, `pin`): its nodes carry `pinned_until`, a time
of the tree's clock, and eviction takes unpinned leaves first, pinned ones only
when those are not enough. A pin ends at that time (`expire`, called by every
method that reads pins); pinning a path again extends it. A node is pinned at
least as long as its children (every pin covers a whole path from the root), and
`pinned_size` counts the slots of pinned nodes.

What the tree holds is also named by block hashes (runtime/prefix_hash.py): each node
keeps the hashes of the block boundaries on its edge, and `events` collects those
stored and removed since the front end's router last took them (`events.take()`).
"""

import heapq
import itertools
import time
from typing import Callable

from mlxd.runtime.prefix_hash import PREFIX_BLOCK, ROOT_HASH, block_hashes


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "snapshot",
                 "windows", "held", "pinned_until", "end", "hashes")

    def __init__(self, parent: "Node | None" = None, key=(), value=(), windows=(), end=0):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key: list[int] = list(key)      # token ids on the edge into this node
        self.value: list[int] = list(value)  # their slot ids
        self.lock_ref = 0
        self.last_access = 0
        self.snapshot = 0   # state slot of the state at the end of the edge (0: none)
        # window pool: their window slots (0: not kept; empty without a window pool)
        self.windows: list[int] = list(windows)
        self.held = len(self.windows) - self.windows.count(0)   # window slots kept
        self.pinned_until = 0.0   # cache_control: evicted after unpinned KV until then (0: not)
        self.end = end            # the prefix length at the end of the edge
        self.hashes: list[int] = []   # block hashes of the boundaries in (start, end]

    def __lt__(self, other: "Node") -> bool:   # heap order: least recently used first
        return self.last_access < other.last_access


class CacheEvents:
    """Block hashes stored and removed since the last `take` (each hash's latest
    change only), and whether everything before was dropped (`reset`)."""

    def __init__(self):
        self.reset = False
        self._changes: dict[int, bool] = {}   # hash -> stored (True) or removed

    def stored(self, hashes: list[int]) -> None:
        for h in hashes:
            self._changes[h] = True

    def removed(self, hashes: list[int]) -> None:
        for h in hashes:
            self._changes[h] = False

    def dropped_all(self) -> None:
        self.reset, self._changes = True, {}

    def __bool__(self) -> bool:
        return self.reset or bool(self._changes)

    def take(self) -> tuple[bool, list[int], list[int]]:
        """(reset, stored, removed), and start over."""
        taken = (self.reset, [h for h, s in self._changes.items() if s],
                 [h for h, s in self._changes.items() if not s])
        self.reset, self._changes = False, {}
        return taken


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share, by slice comparisons (C loops, then a
    bisection), not a Python loop per token."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n   # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    def __init__(self, free_slots: Callable[[list[int]], None],
                 free_snapshot: Callable[[int], None] = lambda slot: None,
                 free_windows: Callable[[list[int]], None] = lambda slots: None,
                 clock: Callable[[], float] = time.monotonic):
        self._free_slots = free_slots
        self._free_snapshot = free_snapshot
        self._free_windows = free_windows
        self.num_snapshots = 0
        self.num_windows = 0   # window slots the tree keeps
        self._clock = itertools.count(1)
        self.root = Node()
        self.root.lock_ref = 1
        self.evictable_size = 0   # slots in unlocked nodes
        self.protected_size = 0   # slots in nodes some running request locks
        self.version = 0          # changes whenever a match could return another length
        self.now = clock          # the pins' clock (seconds)
        self.pinned_size = 0      # slots in pinned nodes
        self.pinned_evicted = 0   # slots of pinned nodes evicted before their pin ended
        self._expiry: list[tuple[float, int, Node]] = []   # (pinned_until, seq, node)
        self._pin_seq = itertools.count()
        self.events = CacheEvents()

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- lookup and insertion ---------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node]:
        """Slots of the longest cached prefix of `tokens`, and the node it ends at
        (split so that the prefix ends exactly on a node)."""
        node, _, slots, _ = self._walk(tokens)
        return slots, node

    def insert(self, tokens: list[int], slots: list[int], windows: list[int] = ()) -> int:
        """Cache `slots` (and their `windows`, with a window pool) for `tokens`.
        Returns how many leading tokens were already cached: the caller still owns
        `slots[:that]` and `windows[:that]` and must free the ones that are not the
        tree's own (duplicates computed while the prefix was cached)."""
        assert len(tokens) == len(slots) and len(windows) in (0, len(slots))
        node, i, _, now = self._walk(tokens)
        if i < len(tokens):
            leaf = Node(node, tokens[i:], slots[i:], windows[i:], end=len(tokens))
            leaf.last_access = now
            leaf.hashes = block_hashes(tokens, i - i % PREFIX_BLOCK, self._last_hash(node))
            self.events.stored(leaf.hashes)
            node.children[tokens[i]] = leaf
            self.evictable_size += len(leaf.value)
            self.num_windows += leaf.held
            self.version += 1
        return i

    def adopt_windows(self, tokens: list[int], windows: list[int], n: int) -> list[int]:
        """Positions [0, n) of `tokens` are cached: where the tree kept no window
        slot and `windows` has one, the tree takes it. Returns the rest of
        `windows[:n]` (held elsewhere already: the caller frees them)."""
        node, i, left = self.root, 0, []
        while i < n:
            node = node.children[tokens[i]]
            for j in range(len(node.key)):
                w = windows[i + j] if i + j < n else 0
                if w and not node.windows[j]:
                    node.windows[j] = w
                    node.held += 1
                    self.num_windows += 1
                    self.version += 1
                elif w:
                    left.append(w)
            i += len(node.key)
        return left

    @staticmethod
    def path_windows(node: Node) -> list[int]:
        """The window slots of the prefix ending at `node`, root first."""
        parts = []
        while node.parent is not None:
            parts.append(node.windows)
            node = node.parent
        return [w for part in reversed(parts) for w in part]

    def path_hashes(self, node: Node) -> list[int]:
        """The block hashes of the prefix ending at `node` (block_hashes of its
        tokens), root first: each node keeps those of its edge."""
        return [h for n in self.path(node) for h in n.hashes]

    def touch(self, node: Node) -> None:
        """Mark the path root..node as just used (LRU), as a match would."""
        now = next(self._clock)
        while node is not None and node is not self.root:
            node.last_access = now
            node = node.parent

    def _walk(self, tokens: list[int]):
        """Follow `tokens` down the tree, touching each node passed and splitting
        the last edge so the matched part ends on a node. Returns that node, the
        matched length, its slots and the access time used."""
        node, i, slots = self.root, 0, []
        now = next(self._clock)
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = common_prefix_len(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots += child.value
            node, i = child, i + n
        return node, i, slots, now

    def _last_hash(self, node: Node) -> int:
        """The hash of the last block boundary at or before `node`'s end."""
        while node is not self.root and not node.hashes:
            node = node.parent
        return node.hashes[-1] if node is not self.root else ROOT_HASH

    def all_hashes(self) -> list[int]:
        return [h for node in self._nodes() for h in node.hashes]

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; return the new upper node."""
        parent = child.parent
        start = child.end - len(child.key)
        upper = Node(parent, child.key[:n], child.value[:n], child.windows[:n], end=start + n)
        cut = upper.end // PREFIX_BLOCK - start // PREFIX_BLOCK
        upper.hashes, child.hashes = child.hashes[:cut], child.hashes[cut:]
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        if child.pinned_until:   # both halves stay pinned: the upper one expires too
            upper.pinned_until = child.pinned_until
            heapq.heappush(self._expiry, (upper.pinned_until, next(self._pin_seq), upper))
        parent.children[upper.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        child.windows = child.windows[n:]
        child.held -= upper.held
        upper.children[child.key[0]] = child
        return upper

    # ---- snapshots ----------------------------------------------------------------

    def set_snapshot(self, node: Node, slot: int) -> None:
        """`slot` holds the state at the end of `node`'s edge; the tree owns it now."""
        assert node is not self.root and not node.snapshot and slot
        node.snapshot = slot
        self.num_snapshots += 1
        self.version += 1

    def take_lru_snapshot(self) -> int:
        """Take the snapshot of the least recently used unlocked node (its KV stays);
        returns its slot, or 0 when no unlocked node has one."""
        nodes = [n for n in self._nodes() if n.snapshot and n.lock_ref == 0]
        if not nodes:
            return 0
        node = min(nodes, key=lambda n: (n.pinned_until > 0, n.last_access))   # unpinned first
        slot, node.snapshot = node.snapshot, 0
        self.num_snapshots -= 1
        self.version += 1
        return slot

    def _drop(self, node: Node) -> None:
        """Hand a removed node's slots, window slots and snapshot back."""
        self._free_slots(node.value)
        if node.held:
            self._free_windows([w for w in node.windows if w])
            self.num_windows -= node.held
        if node.snapshot:
            self._free_snapshot(node.snapshot)
            self.num_snapshots -= 1

    # ---- pins (cache_control) -------------------------------------------------------

    @staticmethod
    def path(node: Node) -> list[Node]:
        """The nodes root..node, root excluded, root first."""
        nodes = []
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def pin_cost(self, node: Node) -> int:
        """The slots pinning the path root..node would add to `pinned_size`."""
        self.expire()
        return sum(len(n.value) for n in self.path(node) if not n.pinned_until)

    def pin(self, node: Node, until: float) -> list[tuple[int, int]]:
        """Pin the path root..node until `until` (a node pinned longer keeps its
        time). Returns the spans [start, end) of the prefix that were not pinned."""
        self.expire()
        spans, start = [], 0
        for n in self.path(node):
            if not n.pinned_until:
                self.pinned_size += len(n.value)
                spans.append((start, start + len(n.value)))
            if until > n.pinned_until:
                n.pinned_until = until
                heapq.heappush(self._expiry, (until, next(self._pin_seq), n))
            start += len(n.value)
        return spans

    def expire(self) -> None:
        """End the pins whose time has come."""
        now = self.now()
        while self._expiry and self._expiry[0][0] <= now:
            until, _, node = heapq.heappop(self._expiry)
            if node.pinned_until == until:   # else pinned again since, or evicted
                self._unpin(node)

    def _unpin(self, node: Node) -> None:
        node.pinned_until = 0.0
        self.pinned_size -= len(node.value)

    # ---- locking ----------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect the path root..node from eviction (one running request)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.value)
                self.protected_size += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlocking a node that is not locked"
            if node.lock_ref == 0:
                self.protected_size -= len(node.value)
                self.evictable_size += len(node.value)
            node = node.parent

    # ---- eviction ---------------------------------------------------------------

    def evict(self, n: int, windows: int = 0) -> int:
        """Free at least `n` slots and `windows` window slots from unlocked leaves,
        least recently used first, unpinned ones before pinned ones (fewer if not
        enough are unlocked). Returns the number of slots freed."""
        self.expire()
        freed, freed_windows = self._evict(n, windows, pinned_too=False)
        if freed < n or freed_windows < windows:
            more, _ = self._evict(n - freed, windows - freed_windows, pinned_too=True)
            freed += more
        return freed

    def _evict(self, n: int, windows: int, pinned_too: bool) -> tuple[int, int]:
        def evictable(node: Node) -> bool:
            return not node.children and node.lock_ref == 0 and (
                pinned_too or not node.pinned_until)

        heap = [node for node in self._nodes() if evictable(node)]
        heapq.heapify(heap)
        freed = freed_windows = 0
        while (freed < n or freed_windows < windows) and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if leaf.pinned_until:
                self.pinned_evicted += len(leaf.value)
                self._unpin(leaf)
            self._drop(leaf)
            self.events.removed(leaf.hashes)
            self.evictable_size -= len(leaf.value)
            freed += len(leaf.value)
            freed_windows += leaf.held
            self.version += 1
            if parent is not self.root and evictable(parent):
                heapq.heappush(heap, parent)
        return freed, freed_windows

    def reset(self) -> None:
        """Drop everything (the worker lost its KV). No node may be locked."""
        assert self.protected_size == 0, "resetting a tree with locked nodes"
        for node in self._nodes():
            self._drop(node)
        self.root.children.clear()
        self.events.dropped_all()
        self.evictable_size = 0
        self.pinned_size, self._expiry = 0, []
        self.version += 1

    def drop_windows(self, n: int, needed: set[int]) -> int:
        """Free at least `n` window slots, least recently used nodes first, locked
        or not, but none in `needed`; their KV slots stay. Returns the number freed."""
        heap = [node for node in self._nodes() if node.held]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            node = heapq.heappop(heap)
            dropped = [w for w in node.windows if w and w not in needed]
            if dropped:
                node.windows = [0 if w and w not in needed else w for w in node.windows]
                node.held -= len(dropped)
                self.num_windows -= len(dropped)
                self._free_windows(dropped)
                freed += len(dropped)
                self.version += 1
        return freed

    # ---- checks -----------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[int]:
        return [s for node in self._nodes() for s in node.value]

    def all_windows(self) -> list[int]:
        """Every window slot the tree keeps."""
        return [w for node in self._nodes() for w in node.windows if w]

    def all_snapshots(self) -> list[int]:
        return [node.snapshot for node in self._nodes() if node.snapshot]

    def check_integrity(self) -> None:
        evictable = protected = windows_held = pinned = 0
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.value), "empty or ragged edge"
            assert len(node.windows) in (0, len(node.value)), "ragged window slots"
            assert node.held == len(node.windows) - node.windows.count(0), "window count"
            assert node.parent.children.get(node.key[0]) is node, "broken parent link"
            start = node.end - len(node.key)
            assert start == (node.parent.end if node.parent is not self.root else 0), "depth"
            assert len(node.hashes) == node.end // PREFIX_BLOCK - start // PREFIX_BLOCK, \
                "block hashes"
            assert node.lock_ref >= 0
            assert node.lock_ref <= node.parent.lock_ref or node.parent is self.root, \
                "a child is locked more than its parent"
            assert node.parent is self.root or \
                node.pinned_until <= node.parent.pinned_until, "a child is pinned longer"
            pinned += len(node.value) if node.pinned_until else 0
            windows_held += node.held
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), \
            f"sizes {(self.evictable_size, self.protected_size)} != {(evictable, protected)}"
        assert windows_held == self.num_windows, "window count"
        assert pinned == self.pinned_size, f"pinned size {self.pinned_size} != {pinned}"
        windows = self.all_windows()
        assert len(set(windows)) == len(windows), "a window slot is cached twice"
        slots = self.all_slots()
        assert len(set(slots)) == len(slots), "a slot is cached twice"
        snapshots = self.all_snapshots()
        assert len(set(snapshots)) == len(snapshots) == self.num_snapshots, "snapshot count"
