"""Request routing over N engine replicas, simulated: the prefix-cache hit rate and
queueing delay of round-robin, least-load and prefix-affinity routing, against one
combined engine as the ceiling.

A discrete-event simulation in pure Python (no MLX, no processes). All three
policies are the front end's own `Router` (tokenizer_proc/router.py) under
RoutePolicy kinds `round_robin`, `least_load` and `cache` (prefix-affinity, with
`--balance-abs`, `--balance-rel`, `--min-match`). Each simulated engine has a real
`RadixCache` (scheduler_proc/radix_cache.py) over a KV pool of `--cache-tokens`
slots, and the Router's index is fed each engine's `events.take()` after every
change to its tree, as the real scheduler does (here at once: the real events ride
on the engine's next TokenBatch).

Traces (seeded, generated here; token ids are random ints, so only real reuse
matches):
  multiturn  chats of 3-8 turns; each turn's prompt is the previous prompt, its
             reply and a new user message; the next turn arrives a think time
             (exponential, mean 10 s) after the reply ends.
  agent      4 shared system prompts of 2-4k tokens; each session picks one, then
             runs 3-10 turns that append a tool call and the tool's output
             (100-1500 tokens; tool time exponential, mean 2 s).
Conversations start as a Poisson process. Both traces scale with the engine count
(`--convs` conversations per engine, arriving N times as fast), so each engine sees
the same load at every N. The arrival rate is set so that `--load` of all slots
would be busy in steady state if every prompt token but the turn's new ones were
cached; policies that miss more work more. `busy` is the share of slots the
requests started while conversations still arrive keep busy (ramp-up included).

Engine model (per engine), the assumptions:
  - at most `--slots` requests run at once; the others wait in a FIFO queue
    (queueing delay = start - arrival). The head of the queue also waits while the
    KV pool cannot hold it (free + evictable slots < its uncached prompt + reply).
  - at start the prompt (less its last token, which is always computed) is matched
    in the tree: the matched tokens are the cached tokens (the hit rate is cached
    / all prompt tokens) and the path is locked. Service time = `--prefill-us` per
    uncached prompt token + `--decode-us` per output token, however many run
    (no batching effects, no chunked prefill).
  - after the prefill the prompt goes into the tree (the lock moves to it, as
    KVBook.cache_progress does); at the end prompt + reply (less its last token)
    go in and the lock is dropped. Slots come from a free list; when short, the
    tree evicts LRU unlocked leaves, at least capacity/64 at a time (KVBook evicts
    in batches too; here it keeps the big combined tree fast).
  - the load the router sees = requests running + queued on the engine, exact and
    current (the real front end counts its own requests per engine too).
The combined reference is one engine with N x the KV pool and N x the slots: one
cache holding everything, one queue for all slots. At the last engine count the
run checks the targets: affinity >= 3x round-robin's hit rate and >= 0.9 of the
combined engine's.

    python bench/router_sim.py                       # both traces, 2 / 8 / 64 engines
    python bench/router_sim.py --engines 64 --traces agent --balance-abs 16
    python bench/router_sim.py --sweep               # RoutePolicy grid at 8 engines

Simulations run `--jobs` at a time (processes; each is deterministic). On 2 cores
the default run takes ~70 s and `--sweep` ~2 min.
"""

import argparse
import array
import heapq
import itertools
import os
import random
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: bench/ is on the path, the root is not
    sys.path.insert(0, str(ROOT))

from mlxd.scheduler_proc.radix_cache import RadixCache   # noqa: E402
from mlxd.tokenizer_proc.router import RoutePolicy, Router   # noqa: E402




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


def conversation(rng: random.Random, prefix: list[int], turns: int, first: tuple,
                 later: tuple, output: tuple, think: float) -> Conversation:
    """`turns` turns after `prefix`: new tokens in the range `first` (the first turn)
    or `later`, a reply in the range `output`, `think` seconds between turns (mean)."""
    return Conversation(0.0, prefix, [
        Turn(random_tokens(rng, rng.randint(*(first if k == 0 else later))),
             random_tokens(rng, rng.randint(*output)),
             0.0 if k == 0 else rng.expovariate(1 / think))
        for k in range(turns)])


def multiturn(rng: random.Random, n: int) -> list[Conversation]:
    """`n` chats: a long first message, short follow-ups, 50-400 token replies,
    ~10 s of think time between turns."""
    return [conversation(rng, [], rng.randint(3, 8), (200, 1200), (20, 300), (50, 400), 10.0)
            for _ in range(n)]


def agent(rng: random.Random, n: int) -> list[Conversation]:
    """`n` sessions over 4 shared system prompts: a task, then tool calls (30-200
    tokens) and tool outputs (100-1500 tokens), ~2 s of tool time between turns."""
    systems = [random_tokens(rng, rng.randint(2000, 4000)) for _ in range(4)]
    return [conversation(rng, rng.choice(systems), rng.randint(3, 10), (50, 300),
                         (100, 1500), (30, 200), 2.0)
            for _ in range(n)]


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
    cached: int = 0               # prompt tokens matched at start
    slots: list[int] = field(default_factory=list)   # KV of prompt + output[:-1]
    prefix_len: int = 0           # leading slots that are the tree's
    node: object = None           # the tree node its lock is on

    @property
    def kv_tokens(self) -> list[int]:
        return self.prompt + self.output[:-1]   # the last output token has no KV


class Engine:
    """One replica: a KV pool under a real radix tree, `slots` requests at a time,
    a FIFO queue for the rest."""

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

    def submit(self, req: Request) -> list[Request]:
        """Queue the request; the ones that start now."""
        self.queue.append(req)
        return self.start_waiting()

    def start_waiting(self) -> list[Request]:
        """Start queued requests, in order, while a slot and their KV are free."""
        started = []
        while self.queue and self.running < self.slots and self._admit(self.queue[0]):
            started.append(self.queue.popleft())
            self.running += 1
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
        self._sync()

    def _cache(self, req: Request, tokens: list[int], slots: list[int]) -> None:
        """Insert into the tree; free our copies of what it held already."""
        already = self.tree.insert(tokens, slots)
        self.free.extend(slots[req.prefix_len:already])

    def check(self, capacity: int) -> None:
        """Idle at the end, every slot either free or the tree's, the tree sound."""
        assert not self.queue and not self.running, "requests left over"
        assert len(self.free) + self.tree.total_size == capacity, "slots lost"
        assert self.tree.protected_size == 0, "a lock left over"
        self.tree.check_integrity()

    def _sync(self) -> None:
        if self.tree.events:
            self.on_events(self.name, *self.tree.events.take())


# ---- policies -----------------------------------------------------------------------


POLICIES = {"round-robin": "round_robin", "least-load": "least_load",
            "prefix-affinity": "cache"}   # the name printed -> RoutePolicy.kind


class Routing:
    """The front end's Router (any of its policy kinds), fed the engines' cache
    events as the front end is (least_load breaks ties by them too; round_robin
    never reads them, so it is spared the bookkeeping)."""

    def __init__(self, policy: RoutePolicy):
        self.router = Router(policy)
        self.blind = policy.kind == "round_robin"

    def choose(self, prompt: list[int], loads: dict[str, int]) -> str:
        return self.router.choose(prompt, loads)[0]

    def observe(self, engine: str, reset: bool, stored, removed) -> None:
        if not self.blind:
            self.router.index.apply(engine, reset, stored, removed)


# ---- the simulation ---------------------------------------------------------------


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


def longest_context(trace: list[Conversation]) -> int:
    return max(len(c.prefix) + sum(len(t.new) + len(t.output) for t in c.turns)
               for c in trace)


def simulate(trace: list[Conversation], engines: int, capacity: int, slots: int,
             policy: RoutePolicy, costs: Costs) -> Result:
    """Serve the trace on `engines` engines of `capacity` KV slots and `slots`
    requests each, routed by a Router under `policy`."""
    if longest_context(trace) > capacity:   # it could never be admitted
        raise SystemExit(f"a KV pool of {capacity} tokens cannot hold the trace's longest "
                         f"context ({longest_context(trace)} tokens)")
    routing = Routing(policy)
    pool = {f"e{i:02d}": Engine(f"e{i:02d}", capacity, slots, costs, routing.observe)
            for i in range(engines)}
    events, seq, result = [], itertools.count(), Result()
    first_arrival, last_arrival = trace[0].arrival, trace[-1].arrival
    busy = 0.0   # slot-seconds of the requests started while conversations arrive

    def push(t: float, kind: int, item) -> None:
        heapq.heappush(events, (t, next(seq), kind, item))

    def started(engine: Engine, reqs: list[Request], now: float) -> None:
        nonlocal busy
        for req in reqs:
            if now <= last_arrival:
                busy += engine.service(req)
            result.prompt_tokens += len(req.prompt)
            result.cached_tokens += req.cached
            result.waits.append(now - req.arrival)
            push(now + engine.prefill_time(req), PREFILLED, (engine, req))
            push(now + engine.service(req), FINISH, (engine, req))

    for conv in trace:
        push(conv.arrival, ARRIVE, Session(conv))
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == ARRIVE:
            turn = item.conv.turns[item.next]
            req = Request(item, item.context + turn.new, turn.output, now)
            name = routing.choose(req.prompt, {n: e.load for n, e in pool.items()})
            started(pool[name], pool[name].submit(req), now)
        elif kind == PREFILLED:
            engine, req = item
            engine.prefilled(req)
        else:
            engine, req = item
            engine.finish(req)
            started(engine, engine.start_waiting(), now)
            next_turn(req, now, push)
    for engine in pool.values():
        engine.check(capacity)
    result.busy = busy / (engines * slots * (last_arrival - first_arrival))
    result.decisions = Counter(routing.router.decisions)
    return result


def next_turn(req: Request, now: float, push) -> None:
    """The reply is in: the conversation's next turn comes after its think time."""
    session = req.conv
    session.context = req.prompt + req.output
    session.next += 1
    if session.next < len(session.conv.turns):
        push(now + session.conv.turns[session.next].think, ARRIVE, session)


def simulate_all(jobs: list[tuple], workers: int) -> list[Result]:
    """simulate(*job) for each job, on up to `workers` processes (each job is
    deterministic: the results do not depend on how they are spread)."""
    if workers <= 1 or len(jobs) == 1:
        return [simulate(*job) for job in jobs]
    with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
        return list(pool.map(simulate, *zip(*jobs)))


def combined_job(trace: list[Conversation], engines: int, args, costs: Costs) -> tuple:
    """One engine with the KV pools and slots of `engines` engines together."""
    return (trace, 1, engines * args.cache_tokens, engines * args.slots,
            RoutePolicy(kind="round_robin"), costs)   # one engine: any policy


def run_policies(trace, engines: int, args, costs: Costs, policy: RoutePolicy) -> dict:
    """{name: Result} for the three policies and the combined engine."""
    jobs = [(trace, engines, args.cache_tokens, args.slots, replace(policy, kind=kind), costs)
            for kind in POLICIES.values()]
    results = simulate_all(jobs + [combined_job(trace, engines, args, costs)], args.jobs)
    return dict(zip([*POLICIES, "combined"], results))


# ---- reports --------------------------------------------------------------------------


def describe(kind: str, trace: list[Conversation], engines: int) -> str:
    turns = sum(len(c.turns) for c in trace)
    span = trace[-1].arrival - trace[0].arrival
    return (f"{kind}, {engines} engines: {len(trace)} conversations, {turns} requests, "
            f"arrivals over {span:.0f} s")


HEADER = (f"{'engines':>7}  {'policy':16s} {'hit':>6} {'wait mean':>9} {'wait p90':>9} "
          f"{'busy':>6}  routed")


def row(engines: int, name: str, r: Result) -> str:
    reasons = " ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())) \
        if name == "prefix-affinity" else ""
    return (f"{engines:>7}  {name:16s} {r.hit_rate:6.3f} {r.wait_mean():9.2f} "
            f"{r.wait_p90():9.2f} {r.busy:6.2f}  {reasons}")


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
        verdict(results, engines)


def verdict(results: dict, engines: int) -> None:
    """The targets at the last engine count: affinity >= 3x round-robin's hit rate
    and >= 0.9 of the combined engine's."""
    aff, rr, comb = (results[k].hit_rate for k in ("prefix-affinity", "round-robin",
                                                    "combined"))
    to_rr = aff / rr if rr else float("inf")
    ceiling = comb / rr if rr else float("inf")

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print(f"{'':9}{engines} engines: affinity / round-robin hit rate {to_rr:.2f}x "
          f"(target >= 3: {met(to_rr >= 3)}; combined / round-robin, the most any "
          f"router could get: {ceiling:.2f}x)")
    print(f"{'':9}{engines} engines: affinity / combined hit rate {aff / comb:.3f} "
          f"(target >= 0.9: {met(aff / comb >= 0.9)})")


SWEEP_ABS = (4, 8, 16, 32, 64)
SWEEP_REL = (1.25, 1.5, 2.0)
SWEEP_MIN = (0.0, 0.1, 0.3, 0.5)


def cell(r: Result) -> str:
    return f"{r.hit_rate:.3f} {r.wait_mean():5.2f} {r.wait_p90():5.2f}"


def sweep(args, costs: Costs, engines: int = 8) -> None:
    """The cache policy over a grid of RoutePolicy settings at `engines` engines."""
    grid = list(itertools.product(SWEEP_ABS, SWEEP_REL, SWEEP_MIN))
    for kind in args.traces:
        trace = make_trace(kind, engines, args, costs)
        jobs = [(trace, engines, args.cache_tokens, args.slots, RoutePolicy(kind=k), costs)
                for k in ("round_robin", "least_load")]
        jobs.append(combined_job(trace, engines, args, costs))
        jobs += [(trace, engines, args.cache_tokens, args.slots,
                  RoutePolicy(b_abs, b_rel, m, "cache"), costs) for b_abs, b_rel, m in grid]
        results = simulate_all(jobs, args.jobs)
        print(f"\n== sweep: {describe(kind, trace, engines)} ==")
        print("each cell: hit rate, mean wait (s), p90 wait (s)")
        for name, r in zip(("round-robin", "least-load", "combined"), results):
            print(f"{name:16s} {cell(r)}")
        cells = iter(results[3:])
        print(f"prefix-affinity\n{'abs':>4} {'rel':>5}  "
              + "  ".join(f"{'min_match ' + str(m):>17}" for m in SWEEP_MIN))
        for b_abs, b_rel in itertools.product(SWEEP_ABS, SWEEP_REL):
            print(f"{b_abs:>4} {b_rel:>5}  "
                  + "  ".join(f"{cell(next(cells)):>17}" for _ in SWEEP_MIN))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[2, 8, 64])
    ap.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES))
    ap.add_argument("--cache-tokens", type=int, default=65536,
                    help="KV pool per engine (running requests' KV and the cache)")
    ap.add_argument("--slots", type=int, default=8, help="requests an engine runs at once")
    ap.add_argument("--prefill-us", type=float, default=200.0, help="per uncached prompt token")
    ap.add_argument("--decode-us", type=float, default=20000.0, help="per output token")
    ap.add_argument("--load", type=float, default=0.8,
                    help="share of all slots busy with ideal caching (sets the arrival rate)")
    ap.add_argument("--convs", type=int, default=32, help="conversations per engine")
    ap.add_argument("--balance-abs", type=int, default=0,
                    help="0: --slots (as the server takes an engine's batch size)")
    ap.add_argument("--balance-rel", type=float, default=RoutePolicy.balance_rel)
    ap.add_argument("--min-match", type=float, default=RoutePolicy.min_match)
    ap.add_argument("--sweep", action="store_true",
                    help="the cache policy over a grid of RoutePolicy settings, 8 engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="simulations run in parallel (processes)")
    args = ap.parse_args()
    costs = Costs(args.prefill_us / 1e6, args.decode_us / 1e6)
    policy = RoutePolicy(args.balance_abs or args.slots, args.balance_rel, args.min_match,
                         "cache")
    print(f"per engine: {args.slots} slots, {args.cache_tokens} KV tokens; prefill "
          f"{args.prefill_us:g} us/token, decode {args.decode_us:g} us/token; load "
          f"{args.load:g}; {args.convs} conversations per engine")
    if not args.sweep:
        print(f"prefix-affinity: {policy}")
    t0 = time.perf_counter()
    if args.sweep:
        sweep(args, costs)
    else:
        main_run(args, costs, policy)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
