"""Which engine a request goes to (pure: no sockets).

Each engine's scheduler reports what its radix tree stores and evicts as block hashes
(runtime/prefix_hash.py) on the TokenBatches it sends anyway; `PrefixIndex` keeps,
per hash, the engines holding it. A tree holds whole paths, so an engine holding a
prompt's k-th block hash holds every one before it: the deepest block any engine
holds is found by binary search, O(log blocks) lookups after hashing the prompt once.

Engines with a disk tier (--kv-disk) also report the prefix hashes where their disk
entries end (an entry holds a run of blocks, so the index sees its end only): a
second `PrefixIndex`, searched from the prompt's last block back (`deepest`, one set
lookup per block). An engine's cached prefix is the longer of the two; memory wins a
tie (a disk hit reads what a memory hit gathers).

`Router.choose` is a cache-aware policy: the least-loaded of the engines holding the
longest cached prefix, when that prefix is at least `min_match` of the prompt and that
engine is not overloaded next to the idlest one (it has more than `balance_abs`
requests more, and more than `balance_rel` times as many); otherwise the least-loaded
engine (ties: the one caching least, which spreads new prefixes over the replicas).
SGLang's router applies the load test to the busiest engine instead, so that one hot
engine sends every request, cached or not, to the idlest; testing the chosen engine
keeps the others' conversations where their cache is (bench/router_sim.py measured
both: the same hit rate at 8 engines, far less queueing, and a threshold that suits
2 and 64 engines alike). The policies "least_load"
and "round_robin" ignore the caches (for comparison).
"""

from collections import Counter
from dataclasses import dataclass, replace

from mlxd.runtime.prefix_hash import PREFIX_BLOCK, block_hashes

REASONS = ("cache", "disk", "load", "affinity", "rerun", "resume")
POLICIES = ("cache", "least_load", "round_robin")
UNSET_BALANCE_ABS = 64   # before an engine said its batch size (mlxd's default one)


class PrefixIndex:
    def __init__(self):
        self.holders: dict[int, set[str]] = {}
        self.held: dict[str, set[int]] = {}   # engine -> its hashes

    def apply(self, engine: str, reset: bool, stored, removed) -> None:
        """One batch of an engine's cache events."""
        if reset:
            self.drop(engine)
        held = self.held.setdefault(engine, set())
        for h in removed:
            if h in held:
                held.discard(h)
                engines = self.holders[h]
                engines.discard(engine)
                if not engines:
                    del self.holders[h]
        for h in stored:
            if h not in held:
                held.add(h)
                self.holders.setdefault(h, set()).add(engine)

    def drop(self, engine: str) -> None:
        """Forget everything `engine` held (it left, or its cache was reset)."""
        for h in self.held.pop(engine, ()):
            engines = self.holders[h]
            engines.discard(engine)
            if not engines:
                del self.holders[h]

    def size(self, engine: str) -> int:
        return len(self.held.get(engine, ()))

    def longest(self, hashes: list[int]) -> tuple[int, set[str]]:
        """The most leading blocks of `hashes` some engine holds, and the engines
        that hold that many."""
        lo, hi = 0, len(hashes)   # blocks [0, lo) are held by someone; hi is an upper bound
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self.holders:
                lo = mid
            else:
                hi = mid - 1
        return lo, (set(self.holders[hashes[lo - 1]]) if lo else set())

    def deepest(self, hashes: list[int]) -> tuple[int, set[str]]:
        """The last block of `hashes` some engine holds (its count from the start),
        and the engines holding it: for holdings that are not prefix-closed."""
        if not self.holders:   # no engine has a disk tier
            return 0, set()
        for k in range(len(hashes), 0, -1):
            engines = self.holders.get(hashes[k - 1])
            if engines:
                return k, set(engines)
        return 0, set()


@dataclass(frozen=True)
class RoutePolicy:
    balance_abs: int = 0        # requests (0: an engine's max_running_requests, `joined`)
    balance_rel: float = 1.5
    min_match: float = 0.1      # share of the prompt's tokens
    kind: str = "cache"         # POLICIES


class Router:
    def __init__(self, policy: RoutePolicy = RoutePolicy()):
        self.policy = policy
        self.index = PrefixIndex()   # the engines' radix trees
        self.disk = PrefixIndex()    # where their disk tiers' entries end
        self.decisions: Counter[str] = Counter()   # by reason (REASONS)
        self._turn = 0   # round_robin's

    def choose(self, input_ids: list[int], loads: dict[str, int]) -> tuple[str, str]:
        """(engine, reason) for a prompt, among the engines in `loads` (the ones up,
        with the requests each runs or queues); `loads` must not be empty."""
        engine, reason = self._choose(input_ids, loads)
        self.decisions[reason] += 1
        return engine, reason

    def _choose(self, input_ids: list[int], loads: dict[str, int]) -> tuple[str, str]:
        if self.policy.kind == "round_robin":
            self._turn += 1
            return sorted(loads)[self._turn % len(loads)], "load"
        least = min(loads, key=lambda e: (loads[e], self.index.size(e), e))
        if len(loads) == 1 or self.policy.kind == "least_load":
            return least, "load"
        blocks, holders, reason = self._cached(block_hashes(input_ids), loads)
        if holders and blocks * PREFIX_BLOCK >= self.policy.min_match * len(input_ids):
            best = min(holders, key=lambda e: (loads[e], e))
            if not self._overloaded(loads[best], loads[least]):
                return best, reason
        return least, "load"

    def _cached(self, hashes: list[int], loads: dict[str, int]) -> tuple[int, set[str], str]:
        """The most leading blocks an engine in `loads` holds, in memory or on disk,
        which engines hold them, and where ("cache": memory, "disk")."""
        blocks, holders = self.index.longest(hashes)
        on_disk, disk_holders = self.disk.deepest(hashes)
        holders, disk_holders = holders & loads.keys(), disk_holders & loads.keys()
        if disk_holders and (on_disk > blocks or not holders):
            return on_disk, disk_holders, "disk"
        return blocks, holders, "cache"

    def _overloaded(self, load: int, least: int) -> bool:
        limit = self.policy.balance_abs or UNSET_BALANCE_ABS
        return load - least > limit and load > self.policy.balance_rel * least

    def joined(self, max_running_requests: int) -> None:
        """The first engine's batch size: the overload threshold where none was set."""
        if not self.policy.balance_abs:
            self.policy = replace(self.policy, balance_abs=max_running_requests)

    def forget(self, engine: str) -> None:
        """`engine` left: nothing it held counts."""
        self.index.drop(engine)
        self.disk.drop(engine)

    def count(self, reason: str) -> None:
        self.decisions[reason] += 1
