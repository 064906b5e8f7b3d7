"""The engines behind the front end, and what each is doing for it (pure: no sockets).

An engine is one scheduler and its worker. It joins by sending SchedulerReady over
its link and leaves when the link ends (its process died, its machine vanished, its
heartbeats stopped). `EngineSet` sits between the TokenizerCore's messages and the
links: `dispatch` names the engine each message goes to (a request by the Router, its
other choices to the same engine, an abort to its request's engine, a stats query to
all), `on_batch` and `on_stats` take what engines send back, and `lost` says what
becomes of an engine's requests when it leaves: each goes on elsewhere. One that has
streamed no token yet runs again whole; one that has is *resumed*: a prefill of its
prompt and the tokens it streamed, its sampling state rebuilt from them by the
scheduler and the worker as after a retraction, so a greedy or seeded stream goes on
exactly as it would have. A request resumed once already that is running at a second
loss ends with an error (request_limits.resume_refusal). While no engine is up,
requests are *parked* until one joins, for at most `park_seconds`.
"""

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

from mlxd.protocol import (
    Abort, GetStats, SchedulerReady, Stats, TokenBatch, TokenEntry, TokenizedRequest,
)
from mlxd.runtime.request_limits import resume_refusal

from .router import Router

log = logging.getLogger("mlxd.tokenizer")

Outgoing = list[tuple[str, object]]   # (engine, message)


class Ended(NamedTuple):
    """A request the front end ends itself (the core sends its last chunk)."""

    rid: int
    reason: str           # "error" or "abort"
    message: str | None


@dataclass
class Sent:
    """What the front end keeps of an unfinished request to go on with it elsewhere:
    the request as first sent, the tokens its engines streamed, and how often it was
    resumed (here or, as its usage said, by its scheduler after a worker's death)."""

    request: TokenizedRequest
    output_ids: list[int] = field(default_factory=list)
    resumes: int = 0          # process deaths (or engine losses) it was running at
    aborted: bool = False     # an Abort went to its engine: it is not to go on
    placed: bool = False      # it was sent to an engine (once parked, maybe not yet)
    parked_until: float | None = None   # waiting for an engine to join, until then

    @property
    def started(self) -> bool:
        return bool(self.output_ids)

    def resumed(self) -> TokenizedRequest:
        """The request to send to another engine after its engine left: whole if it
        streamed nothing; either way counting that loss (a prompt that kills what
        runs it is not run a third time)."""
        self.resumes += 1
        return replace(self.request, output_ids=list(self.output_ids), resumes=self.resumes)


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
    def __init__(self, router: Router | None = None, park_seconds: float = 360.0,
                 clock: Callable[[], float] = time.monotonic):
        """`park_seconds`: how long a request waits for an engine while none is up
        (the server's: --worker-timeout + --model-load-timeout)."""
        self.router = router or Router()
        self.engines: dict[str, Engine] = {}
        self.first: SchedulerReady | None = None   # the limits every engine must meet
        self.park_seconds = park_seconds
        self.clock = clock
        self._engine_of: dict[int, str] = {}
        self._sent: dict[int, Sent] = {}   # every unfinished request, placed or parked
        self._stats: dict[int, _StatsWait] = {}
        self.joins = 0
        self.losses = 0
        self.resumes = 0   # requests that went on elsewhere after streaming tokens

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

    def lost(self, name: str) -> tuple[Outgoing, list[Ended]]:
        """`name` left: its requests go on elsewhere (or wait, parked, for an engine
        to join); those aborted, or resumed once already, end."""
        engine = self.engines.pop(name, None)
        self.router.forget(name)
        if engine is None:
            return [], []
        self.losses += 1
        out: Outgoing = []
        for query_id in list(self._stats):
            out += self._stats_reply(query_id, name, None)
        cause = f"the engine running the request ({name}) was lost"
        ended: list[Ended] = []
        for rid in sorted(engine.rids):
            del self._engine_of[rid]
            sent = self._sent[rid]
            why = resume_refusal(sent.resumes, cause)
            if sent.aborted or why:
                del self._sent[rid]
                ended.append(Ended(rid, "abort", None) if sent.aborted
                             else Ended(rid, "error", why))
                continue
            out += self._go_on(sent)
        return out, ended

    def _go_on(self, sent: Sent) -> Outgoing:
        """Send a request whose engine left to another (parked while none is up)."""
        if not self.engines:
            sent.parked_until = self.clock() + self.park_seconds
            return []
        if not sent.placed:   # parked before it ever reached an engine
            return self._send(sent.request)
        self.router.count("resume" if sent.started else "rerun")
        self.resumes += sent.started
        return self._send(sent.resumed())

    def unpark(self) -> Outgoing:
        """An engine joined: the parked requests go to it (and any other up)."""
        out: Outgoing = []
        for sent in [s for s in self._sent.values() if s.parked_until is not None]:
            sent.parked_until = None
            out += self._go_on(sent)
        return out

    def expire(self) -> list[Ended]:
        """Parked requests that waited `park_seconds` for an engine end."""
        now = self.clock()
        late = [rid for rid, s in self._sent.items()
                if s.parked_until is not None and now >= s.parked_until]
        for rid in late:
            del self._sent[rid]
        return [Ended(rid, "error", f"no engine could take the request within "
                      f"{self.park_seconds:g} s: no engine is serving the model now")
                for rid in late]

    @property
    def parked(self) -> int:
        return sum(1 for s in self._sent.values() if s.parked_until is not None)

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
        rids += [rid for rid, s in self._sent.items() if s.parked_until is not None]
        self.engines.clear()
        self._engine_of.clear()
        self._sent.clear()
        self.first = None
        return out, rids

    @property
    def up(self) -> list[str]:
        return sorted(self.engines)

    # ---- to the engines ----------------------------------------------------------

    def dispatch(self, messages) -> tuple[Outgoing, list[Ended]]:
        """Where each of the core's messages goes (requests while no engine is up:
        parked); and the requests the front end ends itself (an abort of a parked
        one)."""
        out: Outgoing = []
        ended: list[Ended] = []
        placed: dict[int, str] = {}   # id(input_ids) -> engine: a request's choices share it
        for msg in messages:
            if isinstance(msg, TokenizedRequest):
                self._sent[msg.rid] = Sent(msg, resumes=msg.resumes)
                engine = placed.get(id(msg.input_ids))
                if engine is not None and engine in self.engines:
                    self.router.count("affinity")
                    self._sent[msg.rid].placed = True
                    out.append((self._place(msg, engine), msg))
                else:
                    sent = self._send(msg)
                    out += sent
                    if sent:
                        placed[id(msg.input_ids)] = sent[0][0]
            elif isinstance(msg, Abort):
                ended += self._abort(msg, out)
            elif isinstance(msg, GetStats):
                out += self._ask_stats(msg)
        return out, ended

    def _abort(self, msg: Abort, out: Outgoing) -> list[Ended]:
        sent = self._sent.get(msg.rid)
        if sent is not None and sent.parked_until is not None:
            del self._sent[msg.rid]
            return [Ended(msg.rid, "abort", None)]
        engine = self._engine_of.get(msg.rid)
        if engine is not None:
            out.append((engine, msg))
            if sent is not None:
                sent.aborted = True
        return []

    def _send(self, msg: TokenizedRequest) -> Outgoing:
        """`msg` to the engine the router picks; parked when none is up."""
        if not self.engines:
            self._sent[msg.rid].parked_until = self.clock() + self.park_seconds
            return []
        self._sent[msg.rid].placed = True
        return [(self._place(msg, self._choose(msg)), msg)]

    def _choose(self, msg: TokenizedRequest) -> str:
        loads = {name: e.load for name, e in self.engines.items()}
        engine, _ = self.router.choose(msg.input_ids + msg.output_ids, loads)
        return engine

    def _place(self, msg: TokenizedRequest, engine: str) -> str:
        self.engines[engine].rids.add(msg.rid)
        self.engines[engine].routed += 1
        self._engine_of[msg.rid] = engine
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
            sent = self._sent[entry.rid]
            sent.output_ids += entry.token_ids
            if entry.usage is not None:   # resumes by its scheduler count too
                sent.resumes = max(sent.resumes, entry.usage.resumes)
            if entry.finish_reason:
                del self._engine_of[entry.rid]
                del self._sent[entry.rid]
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
                            "resumes": self.resumes, "parked": self.parked,
                            "decisions": dict(self.router.decisions)}
        return merged

    def check_integrity(self) -> None:
        placed = {rid: e.name for e in self.engines.values() for rid in e.rids}
        assert placed == self._engine_of, (placed, self._engine_of)
        parked = {rid for rid, s in self._sent.items() if s.parked_until is not None}
        assert set(self._sent) == set(self._engine_of) | parked
        assert not parked & set(self._engine_of)


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
