"""scheduler_proc/radix_cache.py: the radix prefix tree, token prefixes -> KV slots.

Small hand-checked examples first, then a randomized workload (fixed seeds) that
plays scheduler requests against the tree with a real SlotAllocator owning the
slots, checked after every operation against a token-level reference model.
"""

import random
from collections import Counter

import pytest

from mlxd.scheduler_proc.allocator import SlotAllocator
from mlxd.scheduler_proc.radix_cache import RadixCache


# ---- helpers ------------------------------------------------------------------------


class FreeLog:
    """free_slots callback that records what the tree hands back."""

    def __init__(self, then=None):
        self.calls: list[list[int]] = []
        self._then = then

    def __call__(self, slots):
        self.calls.append(list(slots))
        if self._then is not None:
            self._then(slots)

    def take(self) -> list[int]:
        out = [s for call in self.calls for s in call]
        self.calls.clear()
        return out


def path_tokens(tree: RadixCache, node) -> list[int]:
    """Tokens on the path root..node."""
    out: list[int] = []
    while node is not tree.root:
        assert node is not None, "node is detached from the tree"
        out[:0] = node.key
        node = node.parent
    return out


def num_nodes(tree: RadixCache) -> int:
    return sum(1 for _ in tree._nodes())


def new_tree():
    log = FreeLog()
    return RadixCache(log), log


def slots_for(tokens, base):
    return [base + i for i in range(len(tokens))]


# ---- deterministic examples ---------------------------------------------------------


def test_empty_tree():
    tree, log = new_tree()
    assert tree.match_prefix([]) == ([], tree.root)
    assert tree.match_prefix([1, 2, 3]) == ([], tree.root)
    assert (tree.evictable_size, tree.protected_size, tree.total_size) == (0, 0, 0)
    assert tree.all_slots() == []
    assert tree.evict(10) == 0
    assert log.take() == []
    tree.check_integrity()


def test_insert_then_match_full():
    tree, _ = new_tree()
    assert tree.insert([1, 2, 3, 4], [11, 12, 13, 14]) == 0
    slots, node = tree.match_prefix([1, 2, 3, 4])
    assert slots == [11, 12, 13, 14]
    assert path_tokens(tree, node) == [1, 2, 3, 4]
    # a longer query matches the whole cached sequence only
    slots, node = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert slots == [11, 12, 13, 14]
    assert path_tokens(tree, node) == [1, 2, 3, 4]
    assert (tree.evictable_size, tree.protected_size) == (4, 0)
    tree.check_integrity()


def test_match_partial_mid_edge_splits_node():
    tree, _ = new_tree()
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert num_nodes(tree) == 1
    slots, node = tree.match_prefix([1, 2, 9])
    assert slots == [11, 12]
    assert path_tokens(tree, node) == [1, 2]        # the prefix ends exactly on a node
    assert node.key == [1, 2] and node.value == [11, 12]
    assert num_nodes(tree) == 2
    tree.check_integrity()
    # the lower half still holds its slots
    assert tree.match_prefix([1, 2, 3, 4]) == ([11, 12, 13, 14], node.children[3])
    assert sorted(tree.all_slots()) == [11, 12, 13, 14]
    assert tree.total_size == 4


def test_match_prefix_of_query_shorter_than_edge():
    tree, _ = new_tree()
    tree.insert([5, 6, 7], [1, 2, 3])
    slots, node = tree.match_prefix([5])
    assert slots == [1] and path_tokens(tree, node) == [5]
    slots, node = tree.match_prefix([5, 6])
    assert slots == [1, 2] and path_tokens(tree, node) == [5, 6]
    assert num_nodes(tree) == 3
    tree.check_integrity()


def test_diverging_sequences():
    tree, _ = new_tree()
    assert tree.insert([1, 2, 3], [11, 12, 13]) == 0
    assert tree.insert([1, 2, 4, 5], [21, 22, 24, 25]) == 2     # [1, 2] already cached
    assert tree.insert([7], [31]) == 0                          # no common prefix
    tree.check_integrity()
    assert tree.match_prefix([1, 2, 3])[0] == [11, 12, 13]
    assert tree.match_prefix([1, 2, 4, 5])[0] == [11, 12, 24, 25]   # tree keeps its own [1, 2]
    assert tree.match_prefix([1, 2, 9])[0] == [11, 12]
    assert tree.match_prefix([1, 9])[0] == [11]
    assert tree.match_prefix([7, 7])[0] == [31]
    assert tree.match_prefix([8])[0] == []
    assert sorted(tree.all_slots()) == [11, 12, 13, 24, 25, 31]
    assert tree.total_size == 6


def test_insert_of_cached_prefix_returns_its_length_and_keeps_tree_slots():
    tree, _ = new_tree()
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert tree.insert([1, 2], [91, 92]) == 2
    assert tree.insert([1, 2, 3, 4], [91, 92, 93, 94]) == 4
    assert tree.insert([], []) == 0
    assert sorted(tree.all_slots()) == [11, 12, 13, 14]
    assert tree.total_size == 4
    assert tree.match_prefix([1, 2, 3, 4])[0] == [11, 12, 13, 14]
    # extending a cached sequence adds only the new tail
    assert tree.insert([1, 2, 3, 4, 5], [91, 92, 93, 94, 95]) == 4
    assert tree.match_prefix([1, 2, 3, 4, 5])[0] == [11, 12, 13, 14, 95]
    assert tree.total_size == 5
    tree.check_integrity()


def test_splits_preserve_slots():
    tree, _ = new_tree()
    tokens = list(range(100, 120))
    slots = list(range(1, 21))
    tree.insert(tokens, slots)
    for cut in (17, 3, 11, 1, 19, 8):
        got, node = tree.match_prefix(tokens[:cut] + [0])
        assert got == slots[:cut]
        assert path_tokens(tree, node) == tokens[:cut]
        tree.check_integrity()
    assert num_nodes(tree) == 7
    assert tree.match_prefix(tokens)[0] == slots
    assert sorted(tree.all_slots()) == slots
    assert (tree.evictable_size, tree.protected_size) == (20, 0)


def test_split_of_locked_node_keeps_lock_counts():
    tree, _ = new_tree()
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.lock(node)
    assert (tree.evictable_size, tree.protected_size) == (0, 4)
    _, upper = tree.match_prefix([1, 2])            # splits the locked edge
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (0, 4)
    assert upper.lock_ref == node.lock_ref == 1
    tree.unlock(node)                               # walks through the new upper node
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (4, 0)


def test_lock_unlock_counting_two_requests_on_overlapping_paths():
    tree, _ = new_tree()
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    tree.insert([1, 2, 5, 6], [21, 22, 25, 26])
    slots_a, node_a = tree.match_prefix([1, 2, 3, 4])
    slots_b, node_b = tree.match_prefix([1, 2, 5, 7])
    assert slots_a == [11, 12, 13, 14] and slots_b == [11, 12, 25]
    assert (tree.evictable_size, tree.protected_size) == (6, 0)

    tree.lock(node_a)
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (2, 4)
    tree.lock(node_b)
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (1, 5)   # only [6] unlocked
    shared = node_a.parent
    assert path_tokens(tree, shared) == [1, 2] and shared.lock_ref == 2

    tree.unlock(node_a)
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (3, 3)   # [1, 2] and [5] still locked
    assert shared.lock_ref == 1

    # the same path locked twice (two requests on one prefix) needs two unlocks
    tree.lock(node_b)
    tree.unlock(node_b)
    assert (tree.evictable_size, tree.protected_size) == (3, 3)
    tree.unlock(node_b)
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (6, 0)
    with pytest.raises(AssertionError):
        tree.unlock(node_b)


def test_lock_of_root_is_a_no_op():
    tree, _ = new_tree()
    tree.insert([1], [5])
    _, root = tree.match_prefix([9])
    assert root is tree.root
    tree.lock(root)
    tree.unlock(root)
    assert (tree.evictable_size, tree.protected_size) == (1, 0)
    tree.check_integrity()


def test_evict_never_frees_locked_nodes():
    tree, log = new_tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([1, 2, 4], [21, 22, 24])
    tree.insert([5, 6], [35, 36])
    _, node = tree.match_prefix([1, 2, 3])
    tree.lock(node)
    assert (tree.evictable_size, tree.protected_size) == (3, 3)
    assert tree.evict(100) == 3                  # fewer than asked: all that is unlocked
    assert sorted(log.take()) == [24, 35, 36]
    tree.check_integrity()
    assert (tree.evictable_size, tree.protected_size) == (0, 3)
    assert tree.match_prefix([1, 2, 3])[0] == [11, 12, 13]
    assert tree.evict(100) == 0
    assert log.take() == []
    tree.unlock(node)
    assert tree.evict(100) == 3
    assert sorted(log.take()) == [11, 12, 13]
    assert tree.total_size == 0
    tree.check_integrity()


def test_evict_is_lru():
    tree, log = new_tree()
    tree.insert([1, 1], [11, 12])       # older
    tree.insert([2, 2], [21, 22])
    tree.insert([3, 3], [31, 32])
    tree.match_prefix([1, 1, 7])        # [1, 1] is now the most recently used
    assert tree.evict(1) == 2
    assert log.take() == [21, 22]
    assert tree.evict(1) == 2
    assert log.take() == [31, 32]
    assert tree.match_prefix([1, 1])[0] == [11, 12]
    tree.check_integrity()


def test_evict_lru_partial_match_refreshes_only_the_matched_part():
    tree, log = new_tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([4], [14])
    tree.match_prefix([1, 9])           # splits; refreshes [1] but not [2, 3]
    assert tree.evict(1) == 2           # [2, 3] is the least recently used leaf
    assert log.take() == [12, 13]
    assert tree.evict(1) == 1
    assert log.take() == [14]
    assert tree.match_prefix([1, 2])[0] == [11]
    tree.check_integrity()


def test_evict_frees_at_least_n_whole_leaves():
    tree, log = new_tree()
    tree.insert([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    assert tree.evict(2) == 5           # a leaf goes whole
    assert sorted(log.take()) == [1, 2, 3, 4, 5]
    assert tree.evict(0) == 0
    tree.check_integrity()


def test_evicting_leaves_makes_parent_evictable():
    tree, log = new_tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([1, 2, 4], [21, 22, 24])
    tree.insert([9, 9, 9, 9, 9], [31, 32, 33, 34, 35])   # newest: survives
    assert tree.evict(3) == 4            # [3], [4], then their parent [1, 2]
    assert sorted(log.take()) == [11, 12, 13, 24]
    assert tree.match_prefix([1, 2])[0] == []
    assert tree.match_prefix([9, 9, 9, 9, 9])[0] == [31, 32, 33, 34, 35]
    tree.check_integrity()


def test_evicting_leaf_under_locked_parent_stops_there():
    tree, log = new_tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    _, node = tree.match_prefix([1, 2])
    tree.lock(node)
    assert tree.evict(10) == 1
    assert log.take() == [13]
    assert tree.match_prefix([1, 2, 3])[0] == [11, 12]
    tree.unlock(node)
    tree.check_integrity()


def test_reset():
    tree, log = new_tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([1, 4], [21, 24])
    tree.insert([5], [35])
    _, node = tree.match_prefix([1, 2])
    tree.lock(node)
    with pytest.raises(AssertionError):
        tree.reset()
    tree.unlock(node)
    log.take()
    tree.reset()
    assert sorted(log.take()) == [11, 12, 13, 24, 35]
    assert (tree.evictable_size, tree.protected_size) == (0, 0)
    assert tree.all_slots() == [] and tree.root.children == {}
    assert tree.match_prefix([1, 2, 3]) == ([], tree.root)
    tree.check_integrity()
    # usable again afterwards
    assert tree.insert([1, 2], [7, 8]) == 0
    assert tree.match_prefix([1, 2])[0] == [7, 8]
    tree.check_integrity()


# ---- randomized workload against a reference model ---------------------------------

ALPHABET = 4          # tokens 0..3: prefixes collide often
MAX_PROMPT = 12
MAX_SEQ = 16          # prompt + extensions
CAPACITY = 48


class Request:
    def __init__(self, seq, slots, matched, node):
        self.seq = seq            # token ids
        self.slots = slots        # one slot per token: the tree's for seq[:matched], its own after
        self.matched = matched    # leading tokens whose slots belong to the (locked) tree path
        self.node = node          # the node it locked; path root..node spells seq[:matched]

    @property
    def owned(self) -> list[int]:
        return self.slots[self.matched:]


class Model:
    """Token-level reference: which prefixes are cached, their slot, their last use."""

    def __init__(self):
        self.cached: dict[tuple, int] = {}
        self.atime: dict[tuple, int] = {}
        self.locks: Counter = Counter()
        self.clock = 0

    def longest(self, seq) -> int:
        k = 0
        while k < len(seq) and tuple(seq[:k + 1]) in self.cached:
            k += 1
        return k

    def match(self, seq) -> list[int]:
        self.clock += 1
        k = self.longest(seq)
        for j in range(1, k + 1):
            self.atime[tuple(seq[:j])] = self.clock
        return [self.cached[tuple(seq[:j])] for j in range(1, k + 1)]

    def insert(self, seq, slots) -> int:
        self.clock += 1
        k = self.longest(seq)
        for j in range(1, len(seq) + 1):
            p = tuple(seq[:j])
            self.cached.setdefault(p, slots[j - 1])
            self.atime[p] = self.clock
        return k

    def protected(self) -> set:
        out = set()
        for p, count in self.locks.items():
            if count:
                out.update(p[:j] for j in range(1, len(p) + 1))
        return out

    def unlocked_leaves(self) -> list[tuple]:
        prot = self.protected()
        return [p for p in self.cached
                if p not in prot and not any(p + (t,) in self.cached for t in range(ALPHABET))]


class Workload:
    def __init__(self, seed: int, capacity: int = CAPACITY):
        self.rng = random.Random(seed)
        self.capacity = capacity
        self.alloc = SlotAllocator(capacity)
        self.freed: list[list[int]] = []
        self.tree = RadixCache(self._free_from_tree)
        self.model = Model()
        self.live: list[Request] = []
        self.stats = Counter()

    def _free_from_tree(self, slots):
        self.freed.append(list(slots))
        self.alloc.free(slots)

    def random_seq(self, lo=0, hi=MAX_PROMPT):
        return [self.rng.randrange(ALPHABET) for _ in range(self.rng.randint(lo, hi))]

    # -- operations mirroring the tree's calls in the model --

    def match(self, seq):
        slots, node = self.tree.match_prefix(seq)
        expected = self.model.match(seq)
        assert slots == expected, f"match_prefix({seq}) -> {slots}, reference says {expected}"
        assert path_tokens(self.tree, node) == list(seq[:len(slots)]), \
            f"match_prefix({seq}) returned a node that does not end the matched prefix"
        return slots, node

    def lock(self, req):
        self.tree.lock(req.node)
        self.model.locks[tuple(req.seq[:req.matched])] += 1

    def unlock(self, req):
        self.tree.unlock(req.node)
        key = tuple(req.seq[:req.matched])
        self.model.locks[key] -= 1
        if not self.model.locks[key]:
            del self.model.locks[key]

    def evict(self, n):
        model = self.model
        prot = model.protected()
        evictable_slots = {s for p, s in model.cached.items() if p not in prot}
        before = self.tree.evictable_size
        assert before == len(evictable_slots)
        before_total = self.tree.total_size
        atime_before = dict(model.atime)

        self.freed.clear()
        got = self.tree.evict(n)
        freed = [s for call in self.freed for s in call]
        self.stats["evicted"] += len(freed)

        assert got == len(freed), f"evict({n}) returned {got} but handed back {len(freed)} slots"
        assert len(set(freed)) == len(freed), f"evict({n}) freed a slot twice: {freed}"
        assert set(freed) <= evictable_slots, \
            f"evict({n}) freed locked or uncached slots {set(freed) - evictable_slots}"
        assert got <= before, f"evict({n}) freed {got} > {before} evictable"
        assert got >= min(n, before), f"evict({n}) freed only {got} of {before} evictable"
        assert self.tree.total_size == before_total - got

        freed_set = set(freed)
        removed = {p for p, s in model.cached.items() if s in freed_set}
        for p in removed:
            del model.cached[p]
            del model.atime[p]
        # only whole subtrees go: what stays is still prefix-closed
        for p in model.cached:
            assert len(p) == 1 or p[:-1] in model.cached, f"evict left {p} without its parent"
        assert not (removed & prot)
        # LRU: nothing evicted was used more recently than an unlocked leaf that stays
        if removed:
            newest_evicted = max(atime_before[p] for p in removed)
            for leaf in model.unlocked_leaves():
                assert model.atime[leaf] >= newest_evicted, \
                    f"evict({n}) freed something used at t={newest_evicted} but kept " \
                    f"{leaf} last used at t={model.atime[leaf]}"
        return got

    def ensure_free(self, need) -> bool:
        if self.alloc.num_free < need:
            self.evict(need - self.alloc.num_free)
            self.check()
        return self.alloc.can_allocate(need)

    # -- request lifecycle --

    def start(self):
        seq = self.random_seq()
        slots, node = self.match(seq)
        req = Request(seq, list(slots), len(slots), node)
        self.lock(req)                       # before evicting, so the match survives
        self.check()
        need = len(seq) - req.matched
        if not self.ensure_free(need):
            self.unlock(req)
            self.stats["rejected"] += 1
            return
        req.slots += self.alloc.allocate(need)
        self.live.append(req)
        self.stats["started"] += 1

    def extend(self, req):
        k = self.rng.randint(1, 3)
        if len(req.seq) + k > MAX_SEQ or not self.ensure_free(k):
            return
        req.seq = req.seq + [self.rng.randrange(ALPHABET) for _ in range(k)]
        req.slots = req.slots + self.alloc.allocate(k)
        self.stats["extended"] += 1

    def insert(self, req) -> int:
        """Cache the request's whole sequence; free its duplicates (as a scheduler would)."""
        expected = self.model.insert(req.seq, req.slots)
        already = self.tree.insert(req.seq, req.slots)
        assert already == expected, f"insert({req.seq}) returned {already}, reference says {expected}"
        assert already >= req.matched, "the request's locked prefix is no longer cached"
        dup = req.slots[req.matched:already]
        self.stats["duplicates"] += len(dup)
        self.alloc.free(dup)
        return already

    def checkpoint(self, req):
        """Cache an unfinished request and move its lock to the new node."""
        self.insert(req)
        slots, node = self.match(req.seq)
        assert len(slots) == len(req.seq)
        new = Request(req.seq, list(slots), len(slots), node)
        self.lock(new)
        self.unlock(req)
        req.slots, req.matched, req.node = new.slots, new.matched, new.node
        self.stats["checkpointed"] += 1

    def finish(self, req):
        self.insert(req)
        self.unlock(req)
        self.live.remove(req)
        self.stats["finished"] += 1

    def abort(self, req):
        self.alloc.free(req.owned)
        self.unlock(req)
        self.live.remove(req)
        self.stats["aborted"] += 1

    def reset(self):
        assert not self.live
        self.freed.clear()
        self.tree.reset()
        freed = [s for call in self.freed for s in call]
        assert sorted(freed) == sorted(self.model.cached.values())
        self.model.cached.clear()
        self.model.atime.clear()
        self.stats["resets"] += 1

    # -- the checks run after every operation --

    def check(self):
        tree, alloc, model = self.tree, self.alloc, self.model
        tree.check_integrity()
        alloc.check_integrity()

        held = [s for req in self.live for s in req.owned]
        assert alloc.num_free + tree.total_size + len(held) == self.capacity, \
            f"slots lost or double-owned: free {alloc.num_free} + tree {tree.total_size} " \
            f"+ requests {len(held)} != {self.capacity}"
        tree_slots = tree.all_slots()
        assert sorted(tree_slots) == sorted(model.cached.values()), "tree holds other slots than the reference"
        assert len(set(held)) == len(held), "two requests own one slot"
        assert not set(held) & set(tree_slots), "a slot is both a request's and the tree's"
        assert all(1 <= s <= self.capacity for s in tree_slots + held)

        prot = model.protected()
        assert tree.protected_size == len(prot), \
            f"protected_size {tree.protected_size}, reference says {len(prot)}"
        assert tree.evictable_size == len(model.cached) - len(prot)

        for req in self.live:
            # nothing a live request has locked was evicted, and its slots are the tree's
            for j in range(1, req.matched + 1):
                assert model.cached.get(tuple(req.seq[:j])) == req.slots[j - 1], \
                    f"locked prefix {req.seq[:j]} lost or changed"
            assert path_tokens(tree, req.node) == req.seq[:req.matched], "a locked node moved"

        # match_prefix agrees with the reference on a live request and on a random sequence
        probes = [self.random_seq()]
        if self.live:
            probes.append(self.rng.choice(self.live).seq)
        for seq in probes:
            self.match(seq)
        tree.check_integrity()

    def step(self):
        rng = self.rng
        r = rng.random()
        if r < 0.30 or not self.live:
            if not self.live and rng.random() < 0.03:
                self.reset()
            elif len(self.live) < 6:
                self.start()
            else:
                self.finish(rng.choice(self.live))
        elif r < 0.45:
            self.extend(rng.choice(self.live))
        elif r < 0.55:
            self.checkpoint(rng.choice(self.live))
        elif r < 0.75:
            self.finish(rng.choice(self.live))
        elif r < 0.82:
            self.abort(rng.choice(self.live))
        else:
            self.evict(rng.randint(0, self.capacity // 2))
        self.check()

    def finish_all(self):
        while self.live:
            req = self.rng.choice(self.live)
            (self.finish if self.rng.random() < 0.8 else self.abort)(req)
            self.check()


SEEDS = range(20)
OPS = 300


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_against_reference(seed):
    w = Workload(seed)
    w.check()
    for _ in range(OPS):
        w.step()
    # the workload really exercised sharing, duplicates and eviction
    assert w.stats["started"] > 20 and w.stats["finished"] > 10
    assert w.stats["evicted"] > 0


def test_random_workload_covers_everything():
    """Across a few seeds every kind of event happens (guards against a vacuous workload)."""
    total = Counter()
    for seed in range(5):
        w = Workload(1000 + seed)
        for _ in range(OPS):
            w.step()
        total += w.stats
    for kind in ("started", "extended", "checkpointed", "finished", "aborted",
                 "evicted", "duplicates", "resets", "rejected"):
        assert total[kind] > 0, f"no {kind} in the workload: {dict(total)}"


@pytest.mark.parametrize("seed", SEEDS)
def test_all_slots_return_after_requests_finish_and_evict(seed):
    w = Workload(seed)
    for _ in range(OPS // 2):
        w.step()
    w.finish_all()
    assert w.tree.protected_size == 0
    assert w.model.locks == Counter()
    w.evict(w.capacity)
    w.check()
    assert w.tree.total_size == 0 and w.tree.all_slots() == []
    assert w.tree.root.children == {}
    assert w.alloc.num_free == w.capacity
    assert sorted(w.alloc.allocate(w.capacity)) == list(range(1, w.capacity + 1))
    w.alloc.check_integrity()


def test_common_prefix_len_equals_a_scan_token_by_token():
    from mlxd.scheduler_proc.radix_cache import common_prefix_len

    def scan(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(11)
    for _ in range(20_000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(10))]
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == scan(a, b)
