"""The engines behind the front end, and what each is doing for it (pure: no sockets).

An engine is one scheduler and its worker. It joins by sending SchedulerReady over
its link and leaves when the link ends (its process died, its machine vanished, its
heartbeats stopped). `EngineSet` sits between the TokenizerCore's messages and the
links: `dispatch` names the engine each message goes to (a request by the Router, its
other choices to the same engine, an abort to its request's engine, a stats query to
all), `on_batch` and `on_stats` take what engines send back, and `lost` says what
becomes of an engine's requests when it leaves: one that has streamed no token yet
runs again elsewhere, one that has ends with an error (the core's to finish).
"""

import logging
from dataclasses import dataclass, field

from mlxd.protocol import Abort, GetStats, SchedulerReady, Stats, TokenBatch, TokenizedRequest

from .router import Router

log = logging.getLogger("mlxd.tokenizer")

Outgoing = list[tuple[str, object]]   # (engine, message)


@dataclass
class Engine:
    name: str
    ready: SchedulerReady
    rids: set[int] = field(default_factory=set)   # its requests not yet finished
    routed: int = 0   # requests sent to it, ever

    @property
    def load(self) -> int:
        return len(self.rids)


@dataclass
class _StatsWait:
    waiting: set[str]
    replies: dict[str, dict] = field(default_factory=dict)


class EngineSet:
    def __init__(self, router: Router | None = None):
        self.router = router or Router()
        self.engines: dict[str, Engine] = {}
        self.first: SchedulerReady | None = None   # the limits every engine must meet
        self._engine_of: dict[int, str] = {}
        self._unstarted: dict[int, TokenizedRequest] = {}   # no token streamed yet
        self._stats: dict[int, _StatsWait] = {}
        self.joins = 0
        self.losses = 0

    # ---- membership ------------------------------------------------------------

    def join(self, name: str, ready: SchedulerReady) -> str | None:
        """An engine announced itself (again, after a restart of either end: its
        cache is re-announced in full). Returns why it is refused, or None."""
        if self.first is not None:
            why = mismatch(self.first, ready)
            if why:
                return why
        else:
            self.first = ready
            self.router.joined(ready.max_running_requests)
        assert name not in self.engines, "a re-joining engine is lost first"
        self.engines[name] = Engine(name, ready)
        self.joins += 1
        return None

    def lost(self, name: str) -> tuple[Outgoing, list[int]]:
        """`name` left: its messages to send elsewhere (requests that streamed no token,
        their aborts' targets moved with them) and the rids that must end with an
        error (streaming already, or no engine left to run them)."""
        engine = self.engines.pop(name, None)
        self.router.forget(name)
        if engine is None:
            return [], []
        self.losses += 1
        out: Outgoing = []
        for query_id in list(self._stats):
            out += self._stats_reply(query_id, name, None)
        failed = []
        for rid in sorted(engine.rids):
            del self._engine_of[rid]
            request = self._unstarted.get(rid)
            if request is None or not self.engines:
                self._unstarted.pop(rid, None)
                failed.append(rid)
                continue
            self.router.count("rerun")
            out.append((self._place(request, self._choose(request)), request))
        return out, failed

    def retire_all(self) -> tuple[Outgoing, list[int]]:
        """Every engine leaves on purpose (its model is unloaded): the aborts of its
        unfinished requests, and their rids (the core ends them). Whoever joins next
        sets the limits anew."""
        out: Outgoing = [(engine, Abort(rid)) for rid, engine in self._engine_of.items()]
        rids = sorted(self._engine_of)
        for name in list(self.engines):
            self.router.forget(name)
        for query_id in list(self._stats):   # answered with what came so far
            self._stats[query_id].waiting.clear()
            out += self._stats_reply(query_id, None, None)
        self.engines.clear()
        self._engine_of.clear()
        self._unstarted.clear()
        self.first = None
        return out, rids

    @property
    def up(self) -> list[str]:
        return sorted(self.engines)

    # ---- to the engines ----------------------------------------------------------

    def dispatch(self, messages) -> tuple[Outgoing, list[int]]:
        """Where each of the core's messages goes; and the rids of requests that
        cannot run now (no engine is up), which the core ends with an error."""
        out: Outgoing = []
        failed: list[int] = []
        placed: dict[int, str] = {}   # id(input_ids) -> engine: a request's choices share it
        for msg in messages:
            if isinstance(msg, TokenizedRequest):
                if not self.engines:
                    failed.append(msg.rid)
                    continue
                engine = placed.get(id(msg.input_ids))
                if engine is None:
                    engine = placed[id(msg.input_ids)] = self._choose(msg)
                else:
                    self.router.count("affinity")
                out.append((self._place(msg, engine), msg))
            elif isinstance(msg, Abort):
                engine = self._engine_of.get(msg.rid)
                if engine is not None:
                    out.append((engine, msg))
            elif isinstance(msg, GetStats):
                out += self._ask_stats(msg)
        return out, failed

    def _choose(self, msg: TokenizedRequest) -> str:
        loads = {name: e.load for name, e in self.engines.items()}
        engine, _ = self.router.choose(msg.input_ids, loads)
        return engine

    def _place(self, msg: TokenizedRequest, engine: str) -> str:
        self.engines[engine].rids.add(msg.rid)
        self.engines[engine].routed += 1
        self._engine_of[msg.rid] = engine
        self._unstarted[msg.rid] = msg
        return engine

    def _ask_stats(self, msg: GetStats) -> Outgoing:
        if not self.engines:   # answered at once, with nothing from any engine
            self._stats[msg.query_id] = _StatsWait(set())
            return self._stats_reply(msg.query_id, None, None)
        self._stats[msg.query_id] = _StatsWait(set(self.engines))
        return [(name, msg) for name in self.up]

    # ---- from the engines --------------------------------------------------------

    def on_batch(self, name: str, batch: TokenBatch) -> TokenBatch:
        """Take an engine's batch: its cache events, which requests started and
        which finished. Returns the entries for the core (those of this engine's own
        requests: a request moved away is no longer its to report)."""
        engine = self.engines.get(name)
        if engine is None:   # not joined (any more): nothing of it counts
            return TokenBatch([])
        self.router.index.apply(name, batch.cache_reset, batch.cache_stored,
                                batch.cache_removed)
        self.router.disk.apply(name, batch.disk_reset, batch.disk_stored, batch.disk_removed)
        entries = []
        for entry in batch.entries:
            if self._engine_of.get(entry.rid) != name:
                continue
            if entry.token_ids or entry.finish_reason:
                self._unstarted.pop(entry.rid, None)
            if entry.finish_reason:
                del self._engine_of[entry.rid]
                engine.rids.discard(entry.rid)
            entries.append(entry)
        return TokenBatch(entries)

    def on_stats(self, name: str, stats: Stats) -> Outgoing:
        """An engine's stats; the merged reply (engine "") once every engine asked
        has answered."""
        return self._stats_reply(stats.query_id, name, stats.stats)

    def _stats_reply(self, query_id: int, name: str | None, stats: dict | None) -> Outgoing:
        wait = self._stats.get(query_id)
        if wait is None:
            return []
        if name is not None and name in wait.waiting:
            wait.waiting.discard(name)
            if stats is not None:
                wait.replies[name] = stats
        if wait.waiting:
            return []
        del self._stats[query_id]
        return [("", Stats(query_id, self.merged_stats(wait.replies)))]

    def merged_stats(self, replies: dict[str, dict]) -> dict:
        """One stats dict for all engines: the numbers at the top level summed (with
        one engine: its own stats), each engine's under "engines", and the router's."""
        merged: dict = {}
        for name in sorted(replies):
            add_stats(merged, replies[name])
        merged["engines"] = {name: {**replies[name], "load": self.engines[name].load,
                                    "routed": self.engines[name].routed,
                                    # what the router knows of its caches
                                    "routing_blocks": self.router.index.size(name),
                                    "routing_disk_ends": self.router.disk.size(name)}
                             for name in sorted(replies) if name in self.engines}
        merged["router"] = {"engines_up": len(self.engines), "joins": self.joins,
                            "losses": self.losses,
                            "reruns": self.router.decisions["rerun"],
                            "decisions": dict(self.router.decisions)}
        return merged

    def check_integrity(self) -> None:
        placed = {rid: e.name for e in self.engines.values() for rid in e.rids}
        assert placed == self._engine_of, (placed, self._engine_of)
        assert set(self._unstarted) <= set(self._engine_of)


SUMMED_GROUPS = ("speculative",)   # nested stats whose numbers add up too


def add_stats(total: dict, stats: dict) -> None:
    """Sum `stats`' numbers into `total`; other values: the first engine's."""
    for key, value in stats.items():
        if key in SUMMED_GROUPS and isinstance(value, dict):
            add_stats(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
        else:
            total.setdefault(key, value)


def mismatch(first: SchedulerReady, new: SchedulerReady) -> str | None:
    """Why an engine cannot serve the front end's model beside the first one (every
    request the front end admits must fit it); None when it can."""
    a, b = first.limits, new.limits
    if b.vocab_size != a.vocab_size:
        return f"it serves another model (vocabulary {b.vocab_size}, not {a.vocab_size})"
    if b.max_context < a.max_context or b.kv_capacity < a.kv_capacity:
        return (f"its context ({b.max_context}) or KV pool ({b.kv_capacity} slots) is "
                f"smaller than the first engine's ({a.max_context}, {a.kv_capacity})")
    return None
