"""A stub worker that models the KV pool, for driving the pure Scheduler in tests.

The Harness checks every Step twice:
  * against the scheduler's books, right after `schedule()`: slots handed out as
    new_slot_ids / decode rows' slots were free (held by no running request and not in the
    radix tree), prefix_slot_ids are cached in the tree (or, without the tree, a chunked
    request's own earlier chunks), budgets and bounds hold;
  * as the worker would run it, in `answer()`: releases name rids the worker holds, the
    decode batch is exactly the worker's batch, and every prefix_slot_ids list reads back
    (from the modelled pool) exactly the tokens the request had.
The modelled pool stores, per slot, a hash of the whole token prefix ending there, so KV
that was overwritten while someone still used it is caught when it is read back. Between
steps every tree node and every running request must read back its own tokens.
With a window pool (`window_capacity`), the modelled window pool is checked the same
way: every prefill's `window` prefix positions before its new tokens read back what
they hold, and a request never holds more than two windows of private window slots.
"""

from collections import defaultdict
from dataclasses import replace

from mlxd.protocol import SamplingParams, Step, StepResult, TokenizedRequest, Usage, WorkerError
from mlxd.runtime.kv_layout import cache_width as round_up
from mlxd.runtime.prefix_hash import block_hashes
from mlxd.runtime.kv_disk import run_name
from mlxd.scheduler_proc.request import Request
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits

EOS = 2
PLAIN = 7    # a token that stops nothing


def prompt_of(rid, n):
    """A prompt that shares nothing with any other rid's."""
    return [rid * 1000 + i for i in range(n)]


def make_request(rid, n=4, max_new=8, stop=(EOS,), sampling=None, prompt=None):
    ids = prompt_of(rid, n) if prompt is None else list(prompt)
    return TokenizedRequest(rid, ids, sampling or SamplingParams(), max_new, list(stop))


def chain(prev: int, token: int) -> int:
    """What a pool slot holds: depends on the token and every token before it."""
    return hash((prev, token))


def by_position(rid, pos):
    """A token that depends on the request and position only: outputs must continue
    seamlessly across a retraction. Never EOS."""
    return 10 + (rid * 31 + pos * 7) % 90


class Harness:
    """A Scheduler, a stub worker with a modelled KV pool, and the checks above."""

    def __init__(self, **limits):
        limits.setdefault("kv_capacity", 64)
        limits.setdefault("max_context", 1000)
        self.s = Scheduler(SchedulerLimits(**limits))
        self.cap = self.s.limits.kv_capacity
        self.prompts: dict[int, list[int]] = {}
        self.entries: dict[int, list] = defaultdict(list)
        self.final: dict = {}                     # rid -> the entry with a finish_reason
        self.first_usage: dict[int, Usage] = {}
        self.resumed: dict[int, int] = {}          # rid -> resumes its entries reported
        self.steps: list[Step] = []
        self.tokens = defaultdict(lambda: PLAIN)  # rid -> token the stub worker answers
        self.token_fn = lambda rid, pos: self.tokens[rid]
        self.in_flight: Step | None = None
        self.retracted: list[tuple[int, int]] = []   # (step_id, rid)
        self.resumes: list[tuple[int, int, list[int]]] = []   # (rid, num_generated, tokens)
        # the worker
        self.pool: dict[int, tuple] = {}           # slot -> (chain hash, token)
        self.batch: dict[int, int] = {}            # decoding rid -> its last sampled token
        self.ctx: dict[int, list[int]] = {}        # rid -> tokens with KV (batch or chunks)
        self.hashes: dict[int, list[int]] = {}
        self.states: dict[int, list[int]] = {}    # state slot -> the tokens its state follows
        self.wpool: dict[int, tuple] = {}          # window slot -> (chain hash, token)
        # the disk tier (kv_disk=True): entry name -> what the worker wrote; survives
        # worker_dies. Reads of `disk_broken` names miss; `disk_gone` is reported next.
        self.disk: dict[str, dict] = {}
        self.disk_broken: set[str] = set()
        self.disk_gone: list[str] = []

    # -- driving --
    def add(self, *msgs):
        for msg in msgs:
            if msg.rid in self.final:              # a finished rid used again
                del self.final[msg.rid]
                self.entries.pop(msg.rid, None)
                self.first_usage.pop(msg.rid, None)
            self.prompts[msg.rid] = list(msg.input_ids)
            self.s.add_request(msg)
            self._after(rejections_possible=True)

    def add_past_the_length_check(self, msg):
        """Queue a request the length rule would refuse (prompt + max_tokens beyond the
        pool), to exercise the scheduler's own recovery when a request outgrows it."""
        self.prompts[msg.rid] = list(msg.input_ids)
        self.s.waiting.add(Request.from_message(msg, msg.max_new_tokens))

    def abort(self, rid):
        self.s.abort(rid)
        self._after()

    def schedule(self) -> Step | None:
        assert self.in_flight is None, "the harness runs one step at a time"
        before = {rid: set(r.slot_ids) for rid, r in self.s.running.items()}
        step = self.s.schedule()
        if step is not None:
            self._check_books(step, before)
            self.steps.append(step)
            self.in_flight = step
        self._after()
        return step

    def answer(self, step: Step, result: StepResult | None = None):
        assert step is self.in_flight
        computed = self._run_worker(step)
        if result is not None:                     # the test's own tokens
            for rid, token in zip(result.rids, result.tokens):
                if rid in self.batch:
                    self.batch[rid] = token
        self.in_flight = None
        self.s.process_result(result or computed)
        self._after()

    def fail(self, step: Step, message="boom"):
        assert step is self.in_flight
        self.in_flight = None
        self.s.fail_step(WorkerError(step.step_id, message))
        self.batch.clear()                         # the worker drops every request's state
        self.ctx.clear()
        self.hashes.clear()
        for slot in [row.slot for row in step.decodes] + \
                [s for p in step.prefills for s in p.new_slot_ids]:
            self.pool[slot] = ("half-written",)
        for slot in [row.window for row in step.decodes if row.window] + \
                [w for p in step.prefills for w in p.new_window_ids]:
            self.wpool[slot] = ("half-written",)
        self._after()

    def abandon(self, step: Step, message="unresponsive"):
        """The step outlives the watchdog: the scheduler fails its requests; then the
        worker runs it late, keeping their state, and its answer is dropped."""
        assert step is self.in_flight
        self.s.abandon_step(WorkerError(step.step_id, message))
        self._after()
        self._run_worker(step)
        self.in_flight = None

    def worker_dies(self, message="the worker died"):
        """The worker process dies (a step may be in flight) and a new one starts with
        an empty pool: none of the old worker's state survives."""
        self.in_flight = None
        self.s.reset_worker(message)
        self.batch.clear()
        self.ctx.clear()
        self.hashes.clear()
        self.pool.clear()
        self.wpool.clear()
        self._after()

    def run_step(self) -> Step | None:
        step = self.schedule()
        if step is not None:
            self.answer(step)
        return step

    def run_until_idle(self, limit=10_000) -> int:
        for n in range(limit):
            if self.run_step() is None:
                assert not self.s.has_work, "work is left but no step is scheduled"
                return n
        raise AssertionError("the scheduler never went idle")

    # -- what happened --
    def output(self, rid) -> list[int]:
        return [t for e in self.entries[rid] for t in e.token_ids]

    def prefills_of(self, rid) -> list:
        return [p for s in self.steps for p in s.prefills if p.rid == rid]

    @property
    def tree_slots(self) -> set[int]:
        tree = self.s.kv.tree
        return set(tree.all_slots()) if tree is not None else set()

    def assert_idle(self):
        """Nothing runs or waits; every slot is free or cached, nothing is locked."""
        assert not self.s.running and not self.s.waiting and not self.s.has_work
        tree = self.s.kv.tree
        cached = tree.total_size if tree is not None else 0
        assert self.s.kv.allocator.num_unheld + cached == self.cap
        assert tree is None or tree.protected_size == 0
        kv = self.s.kv
        cached_windows = len(tree.all_windows()) if tree is not None else 0
        assert kv.windows.num_free + cached_windows == kv.window_capacity

    # -- checks against the scheduler's books, right after schedule() --
    def _check_books(self, step: Step, before: dict[int, set[int]]):
        s, running = self.s, self.s.running
        assert step.step_id == len(self.steps) + 1
        for row in step.decodes:   # each row keeps its wire rules (draft vs draft slots)
            row.check()
        assert len(set(step.decode_rids)) == len(step.decode_rids)
        for rid in before:
            if rid not in running and rid in (r.rid for r in s.waiting):
                self.retracted.append((step.step_id, rid))
        for rid in step.releases:
            assert rid not in running, f"rid {rid} is released but running"
        assert not set(step.releases) & {p.rid for p in step.prefills}
        assert len(running) <= s.limits.max_running_requests
        tree = self.tree_slots
        private = {slot: r.rid for r in running.values() for slot in r.slot_ids[r.prefix_len:]}
        handed = [row.slot for row in step.decodes]
        for row in step.decodes:
            req = running[row.rid]
            assert not req.prefilling and req.slot_ids[-1] == row.slot
        total = 0
        for p in step.prefills:
            req = running[p.rid]
            handed += p.new_slot_ids
            computed = len(p.input_ids) - p.disk_tokens   # the rest is read from disk
            total += computed
            assert 0 < len(p.input_ids) == len(p.new_slot_ids)
            assert 0 < computed <= s.limits.chunked_prefill_size
            assert p.needs_logits == (len(req.slot_ids) == req.num_tokens)
            assert p.needs_logits == (not req.prefilling)   # then it decodes
            assert p.num_generated == len(req.output_ids)
            assert req.slot_ids[:len(p.prefix_slot_ids)] == p.prefix_slot_ids
            assert req.slot_ids[len(p.prefix_slot_ids):] == p.new_slot_ids
            if s.kv.tree is not None:
                assert set(p.prefix_slot_ids) <= tree, "a prefix slot is not cached"
            elif p.prefix_slot_ids:                # only a chunk's own earlier chunks
                assert p.rid in self.ctx and p.rid not in self.batch
        assert total <= s.limits.max_prefill_tokens
        assert sum(not p.needs_logits for p in step.prefills) <= 1   # one chunked request
        assert len(set(handed)) == len(handed), f"a slot is handed out twice: {handed}"
        for slot in handed:
            assert 1 <= slot <= self.cap, f"slot {slot} is outside the pool"
            assert slot not in tree, f"slot {slot} is handed out while cached"
            owner = private.get(slot)
            assert owner is not None
            holders = {rid for rid, slots in before.items() if slot in slots}
            assert not holders & set(running), f"slot {slot} is still held by {holders}"
            for r in running.values():
                assert r.rid == owner or slot not in r.slot_ids, f"slot {slot} is shared"
        self._check_window_books(step, before)
        rows = [running[rid] for rid in step.decode_rids]
        if rows:   # the worker's padded decode caches
            width = round_up(max(len(r.slot_ids) for r in rows))
            assert len(rows) * width <= s.decode_cache_tokens

    def _check_window_books(self, step: Step, before: dict[int, set[int]]):
        kv, running = self.s.kv, self.s.running
        if not kv.window:
            assert all(row.window == 0 for row in step.decodes)
            assert all(not p.prefix_window_ids and not p.new_window_ids for p in step.prefills)
            return
        handed = [row.window for row in step.decodes]
        for row in step.decodes:
            assert row.window and running[row.rid].window_ids[-1] == row.window
        for p in step.prefills:
            req = running[p.rid]
            assert len(p.prefix_window_ids) == len(p.prefix_slot_ids)
            start = len(p.prefix_window_ids)
            reach = max(0, start - kv.window - 1)   # older positions are never read
            assert p.new_window_ids == req.window_ids[start:]
            assert p.prefix_window_ids[reach:] == req.window_ids[reach:start]
            assert not any(p.prefix_window_ids[:reach]), "a window beyond reach is sent"
            assert all(p.new_window_ids[-min(len(p.new_window_ids), kv.window + 1):])
            handed += [w for w in p.new_window_ids if w]
        assert len(set(handed)) == len(handed), "a window slot is handed out twice"
        cached = set(kv.tree.all_windows()) if kv.tree else set()
        assert not set(handed) & cached, "a window slot is handed out while cached"
        for req in running.values():
            private = [w for w in req.window_ids[req.prefix_len:] if w]
            assert len(private) <= 2 * (kv.window + 1), "a request holds old window slots"

    # -- the stub worker --
    def _run_worker(self, step: Step) -> StepResult:
        for rid in step.releases:
            assert rid in self.batch or rid in self.ctx, f"release of {rid} the worker lacks"
            self.batch.pop(rid, None)
            self.ctx.pop(rid, None)
            self.hashes.pop(rid, None)
        assert set(step.decode_rids) == set(self.batch), "decode rids != the worker's batch"
        for spill in step.spills:   # read before any of the Step's writes
            self._spill(spill)
        missed = []
        for rid in set(self.ctx) - set(self.batch) - {p.rid for p in step.prefills}:
            # a request part-way through its chunks may wait for room: it is still
            # prefilling, or it was aborted while this step was in flight
            req = self.s.running.get(rid)
            assert req is None or req.prefilling
        rids, tokens = [], []
        for row in step.decodes:
            rid = row.rid
            self._write(rid, [self.batch[rid]], [row.slot])
            self._write_window(rid, [row.window])
            rids.append(rid)
            tokens.append(self.token_fn(rid, len(self.ctx[rid])))
        for p in step.prefills:
            assert p.rid not in self.batch, f"prefill of {p.rid}, which is decoding"
            p = self._load_disk(p, missed)
            if p.rid in self.ctx:                  # the next chunk
                assert len(p.prefix_slot_ids) == len(self.ctx[p.rid])
                assert self._read(p.prefix_slot_ids) == self.ctx[p.rid]
            else:
                self.ctx[p.rid], self.hashes[p.rid] = [], []
                self._write(p.rid, self._read(p.prefix_slot_ids), p.prefix_slot_ids,
                            check_only=True)
            assert not set(p.new_slot_ids) & set(p.prefix_slot_ids)
            self._check_state(p)
            self._check_window_prefix(p)
            self._write(p.rid, p.input_ids, p.new_slot_ids)
            self._write_window(p.rid, p.new_window_ids or [0] * len(p.input_ids))
            for slot in (p.state_slot, p.snapshot_slot):
                if slot:
                    self.states[slot] = list(self.ctx[p.rid])
            had = self.prompts[p.rid] + self.output(p.rid)
            assert p.num_generated == len(self.output(p.rid))
            assert self.ctx[p.rid] == had[:len(self.ctx[p.rid])], "prefilled wrong tokens"
            if p.needs_logits:
                assert self.ctx[p.rid] == had, "the last chunk does not end the input"
                if p.num_generated:
                    self.resumes.append((p.rid, p.num_generated, list(self.ctx[p.rid])))
                rids.append(p.rid)
                tokens.append(self.token_fn(p.rid, len(self.ctx[p.rid])))
        for rid, token in zip(rids, tokens):
            self.batch[rid] = token
        gone, self.disk_gone = self.disk_gone, []
        return StepResult(step.step_id, rids, tokens, [-0.25 * (i + 1) for i in range(len(rids))],
                          disk_gone=gone, disk_missed=missed)

    def _spill(self, spill):
        """Store what the spill's slots hold (they must hold its tokens), with its
        window tail and state."""
        run = spill.run
        values = [self.pool[s] for s in spill.slot_ids]
        assert [t for _, t in values] == spill.tokens, "a spill of slots holding other tokens"
        assert block_hashes(spill.tokens, 0, run.parent)[-1] == run.end
        entry = {"kv": values, "tail": [self.wpool[w] for w in spill.window_ids]}
        overlap = min(len(values), len(entry["tail"]))
        assert entry["tail"][len(entry["tail"]) - overlap:] == values[len(values) - overlap:]
        if spill.snapshot_slot:
            entry["state"] = list(self.states[spill.snapshot_slot])
            assert entry["state"][-len(spill.tokens):] == spill.tokens
        assert run.resumable == bool(entry["tail"] or entry.get("state") or not (
            self.s.kv.window or self.s.kv.needs_state))
        self.disk[run_name(run)] = entry

    def _load_disk(self, p, missed):
        """As the worker: the disk tokens' KV into their new slots, the prefill then
        computing the rest; unchanged (and missed) when an entry cannot be read."""
        if not p.disk_tokens:
            return p
        plain = replace(p, disk_runs=[], disk_start=0, disk_tokens=0, disk_state_slot=0)
        names = [run_name(r) for r in p.disk_runs]
        if any(n not in self.disk or n in self.disk_broken for n in names):
            missed.append(p.rid)
            return plain
        values = [v for n in names for v in self.disk[n]["kv"]]
        start, n = len(p.prefix_slot_ids), p.disk_tokens
        taken = values[start - p.disk_start:start - p.disk_start + n]
        assert [t for _, t in taken] == p.input_ids[:n], "disk runs of other tokens"
        for slot, value in zip(p.new_slot_ids[:n], taken):
            self.pool[slot] = value
        last, end = self.disk[names[-1]], p.disk_start + len(values)
        for i, w in enumerate(p.new_window_ids[:n]):
            if w:
                at = start + i - (end - len(last["tail"]))
                assert 0 <= at < len(last["tail"]), "a window position the entry lacks"
                self.wpool[w] = last["tail"][at]
        if self.s.kv.needs_state:
            assert start + n == end and p.disk_state_slot and "state" in last
            self.states[p.disk_state_slot] = last["state"]
        return replace(plain, input_ids=p.input_ids[n:], new_slot_ids=p.new_slot_ids[n:],
                       prefix_slot_ids=p.prefix_slot_ids + p.new_slot_ids[:n],
                       prefix_window_ids=(p.prefix_window_ids + p.new_window_ids[:n]
                                          if p.new_window_ids else []),
                       new_window_ids=p.new_window_ids[n:],
                       state_from=p.disk_state_slot if self.s.kv.needs_state else p.state_from)

    def _check_state(self, p):
        """A recurrent model's prefill starts from the state its prefix ends at."""
        if not self.s.kv.needs_state:
            assert p.state_from == p.state_slot == p.snapshot_slot == 0
            return
        assert p.state_slot in (0, self.s.running[p.rid].state_slot)
        if p.prefix_slot_ids:
            assert self.states.get(p.state_from) == self.ctx[p.rid], "a stale state"
        else:
            assert p.state_from == 0

    def _check_window_prefix(self, p):
        """The window before a prefill's new tokens reads back from the window pool."""
        window = self.s.kv.window
        if not window:
            return
        hashes, ctx = self.hashes[p.rid], self.ctx[p.rid]
        assert len(hashes) == len(p.prefix_window_ids)
        for i in range(max(0, len(hashes) - window), len(hashes)):
            w = p.prefix_window_ids[i]
            assert w, f"prefix position {i} of {p.rid} has no window KV"
            assert self.wpool.get(w) == (hashes[i], ctx[i]), f"window slot {w} is stale"

    def _write_window(self, rid, windows):
        """The window KV of the positions just written (the last len(windows))."""
        hashes, ctx = self.hashes[rid], self.ctx[rid]
        n = len(windows)
        for w, h, token in zip(windows, hashes[-n:], ctx[-n:]):
            if w:
                self.wpool[w] = (h, token)

    def _read(self, slots) -> list[int]:
        """The tokens a run of pool slots holds, checking it is one consistent prefix."""
        h, out = 0, []
        for slot in slots:
            assert slot in self.pool, f"slot {slot} was never written"
            assert self.pool[slot][0] == chain(h, self.pool[slot][1]), \
                f"slot {slot} holds KV of another sequence"
            h, token = self.pool[slot]
            out.append(token)
        return out

    def _write(self, rid, tokens, slots, check_only=False):
        ctx, hashes = self.ctx[rid], self.hashes[rid]
        for token, slot in zip(tokens, slots, strict=True):
            hashes.append(chain(hashes[-1] if hashes else 0, token))
            ctx.append(token)
            if check_only:
                assert self.pool[slot] == (hashes[-1], token)
            else:
                self.pool[slot] = (hashes[-1], token)

    # -- after every call --
    def _after(self, rejections_possible=False):
        self.s.check_integrity()
        for entry in self.s.take_outputs():
            rid = entry.rid
            assert rid not in self.final, f"entry for {rid} after it finished"
            assert len(entry.token_ids) == len(entry.logprobs) <= 1
            had = len(self.output(rid))
            self.entries[rid].append(entry)
            n = len(self.prompts[rid])
            if not entry.token_ids and not entry.finish_reason:   # resumed: told at once
                assert entry.usage.resumes == self.resumed.get(rid, 0) + 1
                assert entry.usage.completion_tokens == had
                self.resumed[rid] = entry.usage.resumes
                continue
            if entry.finish_reason:
                self.final[rid] = entry
                if entry.usage is None:            # rejected before it was queued
                    assert rejections_possible and entry.finish_reason == "error"
                    assert entry.token_ids == [] and had == 0
                    continue
                assert entry.usage.prompt_tokens == n
                assert entry.usage.completion_tokens == len(self.output(rid))
                assert 0 <= entry.usage.cached_tokens < n
                if rid in self.first_usage:
                    assert entry.usage.cached_tokens == self.first_usage[rid].cached_tokens
            elif had == 0:                         # the first token carries usage
                assert entry.token_ids and entry.usage is not None
                assert entry.usage.prompt_tokens == n
                assert entry.usage.completion_tokens == 1
                assert 0 <= entry.usage.cached_tokens < n
                self.first_usage[rid] = entry.usage
            else:
                assert entry.token_ids and entry.usage is None
        if self.in_flight is None:
            self._check_pool()

    def _check_pool(self):
        """Every cached prefix and every running request reads back its own tokens."""
        tree = self.s.kv.tree
        if tree is not None:
            stack = [(tree.root, 0)]
            while stack:
                node, h = stack.pop()
                for child in node.children.values():
                    hh = h
                    windows = child.windows or [0] * len(child.key)
                    for token, slot, w in zip(child.key, child.value, windows):
                        hh = chain(hh, token)
                        assert self.pool.get(slot) == (hh, token), f"cached slot {slot} is stale"
                        assert not w or self.wpool.get(w) == (hh, token), f"window {w} is stale"
                    stack.append((child, hh))
        for req in self.s.running.values():
            assert self._read(req.slot_ids) == req.all_ids[:len(req.slot_ids)]
            # its private window slots and the ones its next step reads (older ones in
            # its view may have been dropped by the tree since)
            h, reads = 0, len(req.window_ids) - self.s.kv.window - 1
            for i, (token, w) in enumerate(zip(req.all_ids, req.window_ids)):
                h = chain(h, token)
                if w and (i >= req.prefix_len or i >= reads):
                    assert self.wpool.get(w) == (h, token), f"window {w} is stale"


def prefilled(step) -> list[int]:
    return [p.rid for p in step.prefills]


def run_to_finish(h, *msgs):
    h.add(*msgs)
    h.run_until_idle()
