"""Request routing over N engine replicas, simulated: the prefix-cache hit rate and
queueing delay of round-robin, least-load and prefix-affinity routing (the front
end's `Router`, tokenizer_proc/router.py), against one combined engine as the ceiling.

A discrete-event simulation in pure Python (no MLX, no processes). Each simulated
engine has a real `RadixCache` (scheduler_proc/radix_cache.py) over a KV pool of
`--cache-tokens` slots, and the affinity policy's `Router` is fed each engine's
`events.take()` after every change to its tree, as the real scheduler does (here
at once: the real ones ride on the next TokenBatch).

Traces (seeded, generated here; token ids are random ints, so only real reuse
matches):
  multiturn  chats of 3-8 turns; each turn's prompt is the previous prompt, its
             reply and a new user message; the next turn arrives a think time
             (exponential) after the reply ends; chats start as a Poisson process.
  agent      4 shared system prompts of 2-4k tokens; each session picks one, then
             runs 3-10 turns that append a tool call and the tool's output (a
             shorter, exponential tool time between turns).
Both traces scale with the engine count (`--convs` chats or sessions per engine,
arriving N times as fast), so each engine sees the same load at every N. The
arrival rate is set so that `--load` of all slots would be busy if every prompt
token but the turn's new ones were cached (the combined engine's operating point);
policies that miss more work more, which the `busy` column shows.

Engine model (per engine):
  - at most `--slots` requests run at once; the others wait in a FIFO queue
    (queueing delay = start - arrival). The head of the queue also waits while the
    KV pool cannot hold it (free + evictable slots < its uncached prompt + output).
  - at start: the prompt (less its last token, which is always computed) is matched
    in the tree; the matched tokens are the cached tokens (the hit rate's
    numerator) and the path is locked. Service time = `--prefill-us` per uncached
    prompt token + `--decode-us` per output token, whatever else runs.
  - after the prefill the prompt goes into the tree (the lock moves to it, as
    KVBook.cache_progress does); at the end prompt + reply (less its last token)
    go in and the lock is dropped. Slots come from a free list; when short, the
    tree evicts LRU unlocked leaves, a batch of at least capacity/64 at a time
    (KVBook evicts in batches too; the batch keeps the big combined tree fast).
  - load, as the router sees it = requests running + queued on the engine.
The combined reference is one engine with N x the KV pool and N x the slots: one
cache holding everything, one queue for all slots.

    python bench/router_sim.py                       # both traces, 2 / 8 / 64 engines
    python bench/router_sim.py --engines 64 --traces agent --cache-tokens 65536
    python bench/router_sim.py --sweep               # RoutePolicy grid at 8 engines
"""

import argparse
import array
import heapq
import itertools
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: bench/ is on the path, the root is not
    sys.path.insert(0, str(ROOT))

from mlxd.scheduler_proc import radix_cache   # noqa: E402
from mlxd.scheduler_proc.radix_cache import RadixCache   # noqa: E402
from mlxd.tokenizer_proc.router import RoutePolicy, Router   # noqa: E402


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """radix_cache.common_prefix_len's result, by slice comparisons (C loops): the
    tree's own token-by-token loop dominates a simulation of long prompts."""
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


radix_cache.common_prefix_len = common_prefix_len   # same results, faster (only here)


# ---- traces -----------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    new: list[int]      # tokens appended to the context before the turn (user / tool)
    output: list[int]   # the reply
    think: float        # seconds between the previous reply's end and this turn


@dataclass(frozen=True)
class Conversation:
    arrival: float      # of its first turn
    prefix: list[int]   # a shared system prompt, or nothing
    turns: list[Turn]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return list(array.array("I", rng.randbytes(4 * n)))


def multiturn(rng: random.Random, n: int) -> list[Conversation]:
    """`n` chats: a long first message, short follow-ups, 50-400 token replies,
    ~10 s of think time between turns."""
    convs = []
    for _ in range(n):
        turns = [Turn(random_tokens(rng, rng.randint(200, 1200) if k == 0 else rng.randint(20, 300)),
                      random_tokens(rng, rng.randint(50, 400)),
                      0.0 if k == 0 else rng.expovariate(1 / 10))
                 for k in range(rng.randint(3, 8))]
        convs.append(Conversation(0.0, [], turns))
    return convs


def agent(rng: random.Random, n: int) -> list[Conversation]:
    """`n` sessions over 4 shared system prompts: a task, then tool calls (30-200
    tokens) and tool outputs (100-1500 tokens), ~2 s of tool time between turns."""
    systems = [random_tokens(rng, rng.randint(2000, 4000)) for _ in range(4)]
    convs = []
    for _ in range(n):
        turns = [Turn(random_tokens(rng, rng.randint(50, 300) if k == 0 else rng.randint(100, 1500)),
                      random_tokens(rng, rng.randint(30, 200)),
                      0.0 if k == 0 else rng.expovariate(1 / 2))
                 for k in range(rng.randint(3, 10))]
        convs.append(Conversation(0.0, rng.choice(systems), turns))
    return convs


TRACES = {"multiturn": multiturn, "agent": agent}


@dataclass(frozen=True)
class Costs:
    prefill: float   # seconds per uncached prompt token
    decode: float    # seconds per output token

    def service(self, uncached: int, output: int) -> float:
        return self.prefill * uncached + self.decode * output


def ideal_demand(conv: Conversation, costs: Costs) -> float:
    """Slot-seconds the conversation takes when only each turn's new tokens are
    prefilled."""
    return sum(costs.service(len(t.new), len(t.output)) for t in conv.turns)


def make_trace(kind: str, engines: int, args, costs: Costs) -> list[Conversation]:
    """`args.convs` conversations per engine, arriving as a Poisson process at the
    rate that keeps `args.load` of all slots busy (ideal caching)."""
    rng = random.Random(f"{args.seed}-{kind}-{engines}")
    convs = TRACES[kind](rng, args.convs * engines)
    mean_demand = sum(ideal_demand(c, costs) for c in convs) / len(convs)
    rate = args.load * args.slots * engines / mean_demand
    t, timed = 0.0, []
    for c in convs:
        t += rng.expovariate(rate)
        timed.append(Conversation(t, c.prefix, c.turns))
    return timed


# ---- engines ------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    conv: "Session"
    prompt: list[int]
    output: list[int]
    arrival: float
    start: float = 0.0
    cached: int = 0               # prompt tokens matched at start
    slots: list[int] = field(default_factory=list)   # KV of prompt + output[:-1]
    prefix_len: int = 0           # leading slots that are the tree's
    node: object = None           # the tree node its lock is on

    @property
    def kv_tokens(self) -> list[int]:
        return self.prompt + self.output[:-1]   # the last output token has no KV


class Engine:
    def __init__(self, name: str, capacity: int, slots: int, costs: Costs, on_events):
        self.name, self.slots, self.costs = name, slots, costs
        self.free = list(range(1, capacity + 1))
        self.tree = RadixCache(self.free.extend)
        self.evict_batch = max(1, capacity // 64)
        self.on_events = on_events    # (engine name, reset, stored, removed)
        self.queue: deque[Request] = deque()
        self.running = 0

    @property
    def load(self) -> int:
        return self.running + len(self.queue)

    def submit(self, req: Request, now: float) -> list[Request]:
        self.queue.append(req)
        return self.start_waiting(now)

    def start_waiting(self, now: float) -> list[Request]:
        """Start queued requests, in order, while a slot and their KV are free."""
        started = []
        while self.queue and self.running < self.slots and self._admit(self.queue[0]):
            req = self.queue.popleft()
            req.start = now
            self.running += 1
            started.append(req)
        self._sync()
        return started

    def service(self, req: Request) -> float:
        return self.costs.service(len(req.prompt) - req.cached, len(req.output))

    def prefill_time(self, req: Request) -> float:
        return self.costs.service(len(req.prompt) - req.cached, 0)

    def _admit(self, req: Request) -> bool:
        """Match and lock the request's cached prefix and give it slots for the
        rest of its KV; False (nothing held) when the pool cannot."""
        cached, node = self.tree.match_prefix(req.prompt[:-1])
        self.tree.lock(node)
        need = len(req.kv_tokens) - len(cached)
        short = need - len(self.free)
        if short > 0 and self.tree.evictable_size < short:
            self.tree.unlock(node)
            return False
        if short > 0:
            self.tree.evict(max(short, self.evict_batch))
        req.slots = cached + self.free[len(self.free) - need:]
        del self.free[len(self.free) - need:]
        req.cached = req.prefix_len = len(cached)
        req.node = node
        return True

    def prefilled(self, req: Request) -> None:
        """The prompt's KV is computed: share it (KVBook.cache_progress)."""
        n = len(req.prompt)
        self._cache(req, req.prompt, req.slots[:n])
        tree_slots, node = self.tree.match_prefix(req.prompt)
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node, req.prefix_len = node, n
        req.slots = tree_slots + req.slots[n:]
        self._sync()

    def finish(self, req: Request) -> None:
        self._cache(req, req.kv_tokens, req.slots)
        self.tree.unlock(req.node)
        self.running -= 1

    def _cache(self, req: Request, tokens: list[int], slots: list[int]) -> None:
        """Insert into the tree; free our copies of what it held already."""
        already = self.tree.insert(tokens, slots)
        self.free.extend(slots[req.prefix_len:already])

    def _sync(self) -> None:
        if self.tree.events:
            self.on_events(self.name, *self.tree.events.take())


# ---- policies -----------------------------------------------------------------------


class RoundRobin:
    name = "round-robin"

    def __init__(self):
        self.turn = itertools.count()
        self.decisions: Counter[str] = Counter()

    def choose(self, prompt: list[int], loads: dict[str, int]) -> str:
        names = sorted(loads)
        return names[next(self.turn) % len(names)]

    def observe(self, engine: str, reset: bool, stored, removed) -> None:
        pass


class LeastLoad(RoundRobin):
    """Fewest requests running + queued; ties at random (seeded)."""
    name = "least-load"

    def __init__(self, seed: int = 0):
        super().__init__()
        self.rng = random.Random(seed)

    def choose(self, prompt: list[int], loads: dict[str, int]) -> str:
        return min(loads, key=lambda e: (loads[e], self.rng.random()))


class Affinity:
    """The front end's Router, fed the engines' cache events."""
    name = "prefix-affinity"

    def __init__(self, policy: RoutePolicy = RoutePolicy()):
        self.router = Router(policy)
        self.decisions = self.router.decisions

    def choose(self, prompt: list[int], loads: dict[str, int]) -> str:
        return self.router.choose(prompt, loads)[0]

    def observe(self, engine: str, reset: bool, stored, removed) -> None:
        self.router.index.apply(engine, reset, stored, removed)


# ---- the simulation ---------------------------------------------------------------------


class Session:
    """A conversation's progress: its context so far and its next turn."""

    def __init__(self, conv: Conversation):
        self.conv = conv
        self.context = list(conv.prefix)
        self.next = 0


@dataclass
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    waits: list[float] = field(default_factory=list)
    busy: float = 0.0     # share of all slots busy while conversations arrive
    decisions: Counter = field(default_factory=Counter)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    def wait_mean(self) -> float:
        return sum(self.waits) / len(self.waits)

    def wait_p90(self) -> float:
        waits = sorted(self.waits)
        return waits[int(0.9 * (len(waits) - 1))]


ARRIVE, PREFILLED, FINISH = range(3)


def simulate(trace: list[Conversation], engines: int, capacity: int, slots: int,
             policy, costs: Costs) -> Result:
    pool = {f"e{i:02d}": Engine(f"e{i:02d}", capacity, slots, costs, policy.observe)
            for i in range(engines)}
    events, seq, result = [], itertools.count(), Result()
    first_arrival, last_arrival = trace[0].arrival, trace[-1].arrival
    busy = [0.0]   # slot-seconds of the requests started while conversations arrive

    def push(t: float, kind: int, item) -> None:
        heapq.heappush(events, (t, next(seq), kind, item))

    def started(engine: Engine, reqs: list[Request], now: float) -> None:
        for req in reqs:
            if now <= last_arrival:
                busy[0] += engine.service(req)
            result.prompt_tokens += len(req.prompt)
            result.cached_tokens += req.cached
            result.waits.append(now - req.arrival)
            push(now + engine.prefill_time(req), PREFILLED, (engine, req))
            push(now + engine.service(req), FINISH, (engine, req))

    for conv in trace:
        push(conv.arrival, ARRIVE, Session(conv))
    now = 0.0
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == ARRIVE:
            turn = item.conv.turns[item.next]
            req = Request(item, item.context + turn.new, turn.output, now)
            name = policy.choose(req.prompt, {n: e.load for n, e in pool.items()})
            started(pool[name], pool[name].submit(req, now), now)
        elif kind == PREFILLED:
            engine, req = item
            engine.prefilled(req)
        else:
            engine, req = item
            engine.finish(req)
            started(engine, engine.start_waiting(now), now)
            session = req.conv
            session.context = req.prompt + req.output
            session.next += 1
            if session.next < len(session.conv.turns):
                push(now + session.conv.turns[session.next].think, ARRIVE, session)
    result.busy = busy[0] / (engines * slots * (last_arrival - first_arrival))
    result.decisions = Counter(policy.decisions)
    return result


def run_policies(trace, engines: int, args, costs: Costs, policy: RoutePolicy):
    """{name: Result} for the three policies and the combined engine."""
    results = {}
    for p in (RoundRobin(), LeastLoad(args.seed), Affinity(policy)):
        results[p.name] = simulate(trace, engines, args.cache_tokens, args.slots, p, costs)
    results["combined"] = simulate(trace, 1, engines * args.cache_tokens,
                                   engines * args.slots, RoundRobin(), costs)
    return results


# ---- reports --------------------------------------------------------------------------


def describe(kind: str, trace: list[Conversation], engines: int) -> str:
    turns = sum(len(c.turns) for c in trace)
    span = trace[-1].arrival - trace[0].arrival
    return (f"{kind}, {engines} engines: {len(trace)} conversations, {turns} requests, "
            f"arrivals over {span:.0f} s")


def row(engines: int, name: str, r: Result) -> str:
    reasons = " ".join(f"{k} {v}" for k, v in sorted(r.decisions.items()))
    return (f"{engines:>7}  {name:16s} {r.hit_rate:6.3f} {r.wait_mean():9.2f} "
            f"{r.wait_p90():9.2f} {r.busy:6.2f}  {reasons}")


HEADER = f"{'engines':>7}  {'policy':16s} {'hit':>6} {'wait mean':>9} {'wait p90':>9} {'busy':>6}  routed"


def main_run(args, costs: Costs, policy: RoutePolicy) -> None:
    for kind in args.traces:
        print(f"\n== {kind} ==")
        print(HEADER)
        for engines in args.engines:
            trace = make_trace(kind, engines, args, costs)
            t0 = time.perf_counter()
            results = run_policies(trace, engines, args, costs, policy)
            for name, r in results.items():
                print(row(engines, name, r))
            print(f"{'':9}({describe(kind, trace, engines)}; simulated in "
                  f"{time.perf_counter() - t0:.1f} s)")
            if engines == max(args.engines):
                verdict(results, engines)


def verdict(results: dict, engines: int) -> None:
    aff = results["prefix-affinity"].hit_rate
    rr = results["round-robin"].hit_rate
    comb = results["combined"].hit_rate
    ratio_rr = aff / rr if rr else float("inf")
    print(f"{'':9}{engines} engines: affinity / round-robin hit rate = {ratio_rr:.2f}x "
          f"(target >= 3: {'met' if ratio_rr >= 3 else 'NOT met'}); affinity / combined "
          f"= {aff / comb:.3f} (target >= 0.9: {'met' if aff / comb >= 0.9 else 'NOT met'})")


SWEEP_ABS = (4, 8, 16, 32, 64)
SWEEP_REL = (1.25, 1.5, 2.0)
SWEEP_MIN = (0.0, 0.1, 0.3, 0.5)


def sweep(args, costs: Costs, engines: int = 8) -> None:
    """RoutePolicy's grid at `engines` engines: hit rate / p90 wait per setting."""
    for kind in args.traces:
        trace = make_trace(kind, engines, args, costs)
        print(f"\n== sweep: {describe(kind, trace, engines)} ==")
        for name, p in (("round-robin", RoundRobin()), ("least-load", LeastLoad(args.seed))):
            r = simulate(trace, engines, args.cache_tokens, args.slots, p, costs)
            print(f"{name:12s} hit {r.hit_rate:.3f}  wait p90 {r.wait_p90():.2f} s")
        r = simulate(trace, 1, engines * args.cache_tokens, engines * args.slots,
                     RoundRobin(), costs)
        print(f"{'combined':12s} hit {r.hit_rate:.3f}  wait p90 {r.wait_p90():.2f} s")
        print("prefix-affinity, each cell: hit rate / p90 wait (s)")
        print(f"{'abs':>4} {'rel':>5} " + " ".join(f"{'min ' + str(m):>16}" for m in SWEEP_MIN))
        for b_abs, b_rel in itertools.product(SWEEP_ABS, SWEEP_REL):
            cells = []
            for m in SWEEP_MIN:
                p = Affinity(RoutePolicy(balance_abs=b_abs, balance_rel=b_rel, min_match=m))
                r = simulate(trace, engines, args.cache_tokens, args.slots, p, costs)
                cells.append(f"{r.hit_rate:.3f} / {r.wait_p90():6.2f}")
            print(f"{b_abs:>4} {b_rel:>5} " + " ".join(f"{c:>16}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[2, 8, 64])
    ap.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES))
    ap.add_argument("--cache-tokens", type=int, default=65536, help="KV pool per engine")
    ap.add_argument("--slots", type=int, default=8, help="requests an engine runs at once")
    ap.add_argument("--prefill-us", type=float, default=200.0, help="per uncached prompt token")
    ap.add_argument("--decode-us", type=float, default=20000.0, help="per output token")
    ap.add_argument("--load", type=float, default=0.8,
                    help="share of all slots busy with ideal caching (sets the arrival rate)")
    ap.add_argument("--convs", type=int, default=32, help="conversations per engine")
    ap.add_argument("--balance-abs", type=int, default=RoutePolicy.balance_abs)
    ap.add_argument("--balance-rel", type=float, default=RoutePolicy.balance_rel)
    ap.add_argument("--min-match", type=float, default=RoutePolicy.min_match)
    ap.add_argument("--sweep", action="store_true", help="RoutePolicy grid at 8 engines")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    costs = Costs(args.prefill_us / 1e6, args.decode_us / 1e6)
    policy = RoutePolicy(args.balance_abs, args.balance_rel, args.min_match)
    print(f"per engine: {args.slots} slots, {args.cache_tokens} KV tokens; prefill "
          f"{args.prefill_us:g} us/token, decode {args.decode_us:g} us/token; load "
          f"{args.load:g}; {args.convs} conversations per engine; {policy}")
    t0 = time.perf_counter()
    if args.sweep:
        sweep(args, costs)
    else:
        main_run(args, costs, policy)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
