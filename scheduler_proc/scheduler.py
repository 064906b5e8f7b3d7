"""The pure scheduler: no sockets, no MLX. Requests in, Steps out, results in, tokens out.

A request's progress is one number, the length of its KV (`len(slot_ids)`: what
the worker computed, or computes in the step in flight); it is behind by the
tokens it has past that (`Request.behind`). Each step every running request
catches up: those one token behind (the token just sampled) decode it, with a
draft after it where speculation proposes one; their slots are made first, by
evicting cached prefixes and, if that is not enough, by retracting the request
with the least progress. Those still prefilling compute their next piece within
the step's token budget, in admission order. The budget left admits waiting
requests, longest cached prefix first, in the waiting queue's order (waiting.py):
each starts at the progress its cached prefix gives, so a prefix hit, a resume
after a retraction and a chunked prefill are one catch-up from different points.
Finished requests and every finished piece go into the radix tree.
"""

import random
import time
from dataclasses import dataclass, replace
from typing import Callable

from mlxd.protocol import (
    REPETITION_CONTEXT, DecodeRow, PrefillInput, Step, StepResult, TokenEntry,
    TokenizedRequest, WorkerError,
)
from mlxd.runtime.flags import ServerFlags
from mlxd.runtime.kv_layout import batch_tokens, decode_cache_budget, row_width
from mlxd.runtime.prefix_hash import PREFIX_BLOCK, block_hashes
from mlxd.runtime.request_limits import length_error, max_new_tokens, resume_refusal

from .disk_tier import DiskHit, DiskTier
from .kv_book import KVBook
from .request import Request, Status
from .speculation import SpecConfig, Speculation
from .waiting import WaitingQueue


_FLAGS = ServerFlags()   # the flags' defaults


@dataclass(frozen=True)
class SchedulerLimits:
    """The worker's figures (from its READY) and the user's flags (defaults: the
    flags' own, runtime/flags.py), plus the scheduler's internal tunables."""

    kv_capacity: int
    max_context: int
    max_running_requests: int = _FLAGS.max_running_requests
    max_prefill_tokens: int = _FLAGS.max_prefill_tokens
    chunked_prefill_size: int = _FLAGS.chunked_prefill_size
    disable_radix_cache: bool = _FLAGS.disable_radix_cache
    decode_cache_tokens: int = 0    # room for the worker's decode caches (0: see below)
    decode_page: int = 0            # their layout: positions per page (0: padded; kv_layout)
    decode_headroom: int = 16       # slots kept free per running request at admission
    cached_token_cost: float = 0.25  # a cached prefix token's share of the prefill budget
    vocab_size: int = 0             # the model's token ids are [0, vocab_size) (0: unchecked)
    state_slots: int = 0            # the worker's recurrent-state slots (0: the model has none)
    snapshot_slots: int = 0         # and its slots for snapshots of states (after those)
    window_capacity: int = 0        # the worker's window pool (0: none)
    window: int = 0                 # the largest sliding window of the model
    max_pinned_tokens: int = _FLAGS.max_pinned_tokens   # cache_control pins' bound (-1: auto)
    pin_ttl_scale: float = 1.0      # multiplies every pin's TTL (MLXD_PIN_TTL_SCALE, tests)
    speculative: SpecConfig = SpecConfig()   # drafts (speculation.py); off by default here
    verifies_drafts: bool = False   # the worker verifies drafts (WorkerLimits)
    worker_overlaps: bool = False   # the worker chains decodes (WorkerLimits.overlap)
    verify_costs: tuple[float, ...] = ()   # the worker's (WorkerLimits; empty: drafts free)
    draft_model: bool = False     # the worker holds a draft model (WorkerLimits.draft_model)
    draft_cost: float = 0.0       # its forward next to the model's (WorkerLimits)
    constraints: bool = True      # the worker runs grammars (WorkerLimits.constraints)
    kv_disk: bool = False         # the worker keeps a disk tier (WorkerLimits.kv_disk)
    kv_disk_entries: tuple[str, ...] = ()   # the entries it holds at start


class Scheduler:
    def __init__(self, limits: SchedulerLimits, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None):
        """`clock`: seconds, for the pins' TTLs; `rng` draws the seeds of requests
        that bring none."""
        self.limits = limits
        self._rng = rng or random.Random()
        self.kv = KVBook(limits.kv_capacity, not limits.disable_radix_cache,
                         limits.state_slots, limits.snapshot_slots,
                         limits.window_capacity, limits.window,
                         limits.max_pinned_tokens, limits.pin_ttl_scale, clock,
                         page=limits.decode_page or 1)
        # the padded layout's decode caches (pages: the rows' KV is the pool's own)
        self.decode_cache_tokens = limits.decode_cache_tokens or decode_cache_budget(
            limits.kv_capacity, limits.max_running_requests)
        self.waiting = WaitingQueue(self.kv)
        self.running: dict[int, Request] = {}   # in admission order
        self._prefilled: list[Request] = []     # requests with a chunk in the last Step
        self._releases: list[int] = []
        self._outbox: list[TokenEntry] = []
        self._step_id = 0
        self.num_retractions = 0
        self.num_resumes = 0   # requests put back to run again after a worker's death
        self.spec = Speculation(limits.speculative, limits.verifies_drafts,
                                list(limits.verify_costs), limits.worker_overlaps,
                                replays=limits.state_slots > 0,
                                draft_model=limits.draft_model, draft_cost=limits.draft_cost)
        self._chained = False   # the worker may have started the next decode already
        if limits.kv_disk:
            self.disk_restarted(list(limits.kv_disk_entries))

    def disk_restarted(self, entries: list[str]) -> None:
        """The worker's disk tier holds `entries` (at start, or a new worker's)."""
        if self.kv.tree is not None and self.limits.kv_disk:
            self.kv.disk = DiskTier(entries, self.kv.window, self.kv.needs_state)

    # ---- inputs -------------------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> None:
        error = self._reject_reason(msg)
        if error:
            self._outbox.append(TokenEntry(msg.rid, [], [], finish_reason="error", error=error))
            return
        max_new = max_new_tokens(len(msg.input_ids), msg.max_new_tokens, self.limits.max_context)
        if msg.sampling.seed is None:   # every request has one: all ranks of a group
            msg = replace(msg, sampling=replace(   # sample alike from it
                msg.sampling, seed=self._rng.getrandbits(63)))
        self.waiting.add(Request.from_message(msg, max_new))

    def abort(self, rid: int) -> None:
        if rid in self.running:
            req = self.running[rid]
            self.kv.drop_tail(req, req.num_tokens)   # draft slots of a step in flight
            self._finish(req, "abort", TokenEntry(rid, [], []))
            return
        req = self.waiting.find(rid)
        if req is not None:
            self.waiting.remove(req)
            req.status = Status.FINISHED
            self._outbox.append(TokenEntry(rid, [], [], finish_reason="abort",
                                           usage=req.usage()))

    def abort_all(self) -> None:
        """Abort every request, running or waiting (their front end is gone)."""
        for rid in [*self.running, *(r.rid for r in self.waiting)]:
            self.abort(rid)

    def take_cache_events(self) -> dict:
        """What the prefix cache and the disk tier stored and removed since the last
        call, as block hashes: TokenBatch's cache_* and disk_* fields
        (radix_cache.CacheEvents)."""
        events = {}
        if self.kv.tree is not None and self.kv.tree.events:
            reset, stored, removed = self.kv.tree.events.take()
            events.update(cache_reset=reset, cache_stored=stored, cache_removed=removed)
        if self.kv.disk is not None and self.kv.disk.events:
            reset, stored, removed = self.kv.disk.events.take()
            events.update(disk_reset=reset, disk_stored=stored, disk_removed=removed)
        return events

    def announce_cache(self) -> None:
        """Make the next events describe the whole cache (a front end that (re)joins
        knows nothing of it)."""
        if self.kv.tree:
            self.kv.tree.events.dropped_all()
            self.kv.tree.events.stored(self.kv.tree.all_hashes())
        if self.kv.disk is not None:
            self.kv.disk.announce()

    @property
    def has_cache_events(self) -> bool:
        return bool(self.kv.tree and self.kv.tree.events) or \
            bool(self.kv.disk is not None and self.kv.disk.events)

    def process_result(self, result: StepResult) -> None:
        if self.kv.disk is not None:
            self._disk_news(result)
        for req in self._prefilled:   # their new KV is in the pool now: share it
            if req.running:
                self.kv.cache_progress(req)
        self._prefilled = []
        tops = result.top_logprobs or [None] * len(result.tokens)
        for rid, run in result.row_runs():
            req = self.running.get(rid)
            if req is None:   # finished or aborted while the step ran
                continue
            self._take_run(req, result.tokens[run], result.logprobs[run], tops[run])

    def _disk_news(self, result: StepResult) -> None:
        """Entries the worker no longer has; prefills that computed what they were
        to read from disk (a read missed)."""
        self.kv.disk.forget(result.disk_gone)
        for rid in result.disk_missed:
            req = self.running.get(rid)
            if req is not None and req.disk_tokens:
                self.kv.disk.missed_tokens += req.disk_tokens
                req.cached_tokens = (req.cached_tokens or 0) - req.disk_tokens
                req.disk_tokens = 0

    def _take_run(self, req: Request, tokens: list[int], logprobs: list[float],
                  tops: list) -> None:
        """A row's tokens of one step (several after a verified draft), up to the
        first that finishes it; the slots of the draft tokens it did not keep go."""
        accepted = self.spec.ran(req, len(tokens))
        reason, n = None, 0
        while reason is None and n < len(tokens):
            req.output_ids.append(tokens[n])
            reason = req.finish_reason_after(tokens[n])
            n += 1
        req.accepted_tokens += min(accepted, n)
        self.kv.drop_tail(req, req.num_tokens - 1)
        entry = TokenEntry(req.rid, tokens[:n], logprobs[:n],
                           None if all(t is None for t in tops[:n]) else tops[:n])
        if len(req.output_ids) == n or req.report_usage:
            entry.usage = req.usage()   # tells the tokenizer cached_tokens (resumes) early
            req.report_usage = False
        if reason:
            self._finish(req, reason, entry)
        else:
            self._outbox.append(entry)

    def fail_step(self, error: WorkerError) -> None:
        """The worker dropped every request's state: running requests go on from
        their tokens so far, and the cache is forgotten (the failed step may have
        half-written the pool)."""
        self.reset_worker(f"the worker failed a step ({error.message})")

    def reset_worker(self, cause: str) -> None:
        """The worker holds nothing: it dropped its state, or a new worker with an
        empty pool replaces a dead one. Running requests are resumed (back to the
        front of the queue, to prefill prompt + output so far, as after a
        retraction), or end with an error naming `cause` when they were resumed
        once already (request_limits.resume_refusal); nothing is released (the
        worker knows none of them), every slot is free and the cache is forgotten;
        waiting requests stay queued for it."""
        for req in sorted(self.running.values(), key=lambda r: -r.arrival):
            why = resume_refusal(req.resumes, cause)
            if why:
                self._finish(req, "error", TokenEntry(req.rid, [], [], error=why),
                             keep_kv=False)
            else:
                self._resume(req)
        self._releases.clear()
        self._prefilled = []
        self.spec.reset()
        self._chained = False
        self.kv.reset_tree()

    def _resume(self, req: Request) -> None:
        """Run `req` again from its tokens so far (its KV is gone)."""
        del self.running[req.rid]
        self.kv.release(req, keep=False)
        req.status = Status.WAITING
        req.resumes += 1
        self.num_resumes += 1
        self.spec.forget(req.rid)
        self.waiting.push_front(req)
        # told now: should this scheduler die before its next token, the front end
        # counts this resume toward the request's limit
        self._outbox.append(TokenEntry(req.rid, [], [], usage=req.usage()))

    def abandon_step(self, error: WorkerError) -> None:
        """The worker has not answered the step in flight: running requests fail and
        the cache is forgotten, as after a WorkerError. The worker, should it answer,
        still holds their state, so the next Step releases them."""
        held = list(self.running) + self._releases
        self.reset_worker(error.message)
        self._releases = held

    # ---- outputs ------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next Step, or None when there is nothing to send."""
        decoding = self._make_room_for_decode()
        rows = [DecodeRow(r.rid, slot, window=r.window_ids[-1] if self.kv.window else 0)
                for r, slot in zip(decoding, self.kv.extend_each(decoding))]
        proposals = self.spec.proposals(decoding)
        self._book_drafts(decoding, rows, proposals)
        prefills = self._schedule_prefills(decoding)
        spills = self.kv.disk.take_spills() if self.kv.disk is not None else []
        if not (decoding or prefills or self._releases or spills):
            return None
        releases, self._releases = self._releases, []
        self._step_id += 1
        # a row with a proposal now likely has one next step: keep that Step unchained
        chain_next = not any(proposals)
        if chain_next and self.limits.worker_overlaps and self.limits.decode_page and decoding:
            pages = self.kv.book_next_pages(decoding)   # pages the chain writes in
            chain_next = pages is not None
            for row, page in zip(rows, pages or []):
                row.chain_page = page
        self._chained = chain_next and self.limits.worker_overlaps
        return Step(self._step_id, rows, prefills, releases, spills, chain_next)

    def _book_drafts(self, reqs: list[Request], rows: list[DecodeRow],
                     proposals: list[list[int]]) -> None:
        """The rows' drafts, their slots and (with a window pool) their window slots
        (the worker's draft model fills the drafts with `spec.by_model`): none after
        a Step the worker may have chained on, none that would take slots not free
        now (drafts evict no cached prefix) or stretch the decode caches past their
        budget."""
        total = sum(len(p) for p in proposals)
        room = sum(self.kv.extend_room(r, len(p)) for r, p in zip(reqs, proposals) if p)
        if self._chained or not total or room > self.kv.allocator.num_free or (
                self.kv.window and total > self.kv.windows.num_free):
            return
        lengths = [len(r.slot_ids) + len(p) for r, p in zip(reqs, proposals)]
        if not self._width_fits_lengths(lengths):
            return
        for req, row, draft in zip(reqs, rows, proposals):
            if not draft:
                continue
            row.draft_slots = self.kv.extend(req, len(draft))
            if self.spec.by_model:   # the worker's draft model fills them
                row.model_draft = len(draft)
            else:
                row.draft = draft
            self.spec.sending(req, draft)

    def take_outputs(self) -> list[TokenEntry]:
        out, self._outbox = self._outbox, []
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._releases)

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "retractions": self.num_retractions, "resumes": self.num_resumes,
                "speculative": self.spec.counters.as_dict(),
                **({"disk": self.kv.disk.stats()} if self.kv.disk is not None else {}),
                **self.kv.stats(list(self.running.values()))}

    def check_integrity(self) -> None:
        self.kv.check_integrity(list(self.running.values()))

    # ---- decode room: evict, then retract ----------------------------------------

    def _make_room_for_decode(self) -> list[Request]:
        decoding = [r for r in self.running.values() if not r.prefilling]
        while decoding and not (self._width_fits(decoding) and self.kv.make_room(
                len(decoding), len(decoding), slots=self.kv.decode_room(decoding))):
            if len(self.running) == 1:   # alone and still too big: it cannot run at all
                req = decoding[0]
                self._finish(req, "error", TokenEntry(req.rid, [], [], error=self._too_big(req)))
                return []
            victim = self._retraction_victim()
            self._retract(victim)
            decoding = [r for r in decoding if r is not victim]
        return decoding

    def _width_fits(self, rows: list[Request], *extra_lens: int) -> bool:
        """The worker's decode caches (kv_layout's rule for its layout) fit the budget
        with `rows` and rows of `extra_lens` about to join."""
        return self._width_fits_lengths([len(r.slot_ids) for r in rows] +
                                        [n for n in extra_lens if n])

    def _width_fits_lengths(self, lengths: list[int]) -> bool:
        """Rows holding `lengths` KV positions fit the padded layout's decode caches
        (always in pages: a row attends its KV in the pool)."""
        return bool(self.limits.decode_page) or batch_tokens(lengths) <= self.decode_cache_tokens

    def _retraction_victim(self) -> Request:
        """The running request with the least progress (then: holding the most KV)."""
        return min(self.running.values(), key=lambda r: (len(r.output_ids), -len(r.slot_ids)))

    def _retract(self, req: Request) -> None:
        """Back to the front of the queue; its KV stays cached for the resume."""
        del self.running[req.rid]
        self.kv.release(req, keep=True)
        req.status = Status.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self._releases.append(req.rid)
        self.waiting.push_front(req)

    def _too_big(self, req: Request) -> str:
        need = len(req.slot_ids) + 1
        if need > self.limits.kv_capacity:
            return (f"the request needs {need} KV slots; the pool holds "
                    f"{self.limits.kv_capacity}")
        if self.limits.decode_page:   # pages: its cached prefix holds pages too
            return (f"the request's KV and the cached prefix it started from need more "
                    f"than the pool's {self.kv.allocator.pages} pages of "
                    f"{self.kv.page} positions")
        width = row_width(len(req.slot_ids))
        return (f"the request needs {width} tokens of decode cache; the "
                f"decode caches may span {self.decode_cache_tokens} tokens")

    # ---- prefill: running requests catch up, then admissions ---------------------------

    def _schedule_prefills(self, decoding: list[Request]) -> list[PrefillInput]:
        """The step's prefill pieces within its token budget: the next piece of each
        running request still prefilling, in admission order, then the first piece
        of waiting requests admitted."""
        budget = self.limits.max_prefill_tokens
        prefills: list[PrefillInput] = []
        rows = list(decoding)   # the decode batch of the next step
        for req in [r for r in self.running.values() if r.prefilling]:
            piece = self._next_piece(req, budget, rows)
            if piece is not None:
                prefills.append(piece)
                budget -= self._cost(piece)
                if piece.needs_logits:
                    rows.append(req)
        order = self.waiting.order()
        for req, cached in order:
            if budget <= 0 or len(self.running) >= self.limits.max_running_requests:
                break
            prefilling = [self.running[p.rid] for p in prefills]
            if req.rid in self._releases or self.waiting.should_wait(req, cached, prefilling):
                continue
            p = self._admit(req, budget, rows, first=not prefills)
            if p is None:
                break
            prefills.append(p)
            budget -= self._cost(p)
            if p.needs_logits:
                rows.append(req)
        self._prefilled = [self.running[p.rid] for p in prefills]
        self.waiting.count_overtakes(order)
        return prefills

    def _cost(self, p: PrefillInput) -> int:
        """A prefill's share of the step budget: its new tokens, plus its cached
        prefix at a fraction (gathering and attending over it takes time too)."""
        return len(p.input_ids) + int(self.limits.cached_token_cost * len(p.prefix_slot_ids))

    def _piece_len(self, req: Request, start: int, budget: int) -> int:
        """How many of the request's tokens after `start` (the KV it has, or will
        have read from disk) it computes in this step's `budget`: what it is behind,
        at most a chunk, at least one."""
        budget -= int(self.limits.cached_token_cost * start)
        n = min(req.num_tokens - start, self.limits.chunked_prefill_size, max(1, budget))
        return self._resume_cut(start, n, req.num_tokens)

    def _pending_rows(self) -> list[int]:
        """The lengths of the running requests still prefilling: each will join the
        decode batch at its whole length."""
        return [r.num_tokens for r in self.running.values() if r.prefilling]

    def _next_piece(self, req: Request, budget: int, rows: list[Request]) -> PrefillInput | None:
        """The next piece of a running request still prefilling, or None while there
        is no room for it."""
        n = self._piece_len(req, len(req.slot_ids), budget)
        last = n == req.behind
        if last and rows and not self._width_fits(rows, req.num_tokens):
            return None   # its row would not fit the decode caches yet: wait
        if not self.kv.make_room(n, self.kv.window_need(n), slots=self.kv.extend_room(req, n)):
            return None
        return self._prefill_input(req, n)

    def _admit(self, req: Request, budget: int, rows: list[Request],
               first: bool) -> PrefillInput | None:
        """Start `req` (its first piece) if memory and the step's budget allow; None
        stops admission. The step's first prefill always gets a token. At most one
        running request is part-way through its prefill."""
        prefix, node = self.kv.match(req.all_ids[:-1])
        total = len(req.prompt_ids) + req.max_new_tokens   # the most it may hold
        fitting = self.kv.fitting_prefix(prefix, total)   # alone, it must fit the pool
        if fitting < len(prefix):
            prefix, node = self.kv.match(req.all_ids[:fitting])
        hit = self._disk_hit(req, prefix, node)
        cached = hit.end if hit else len(prefix)
        if int(self.limits.cached_token_cost * cached) >= budget and not first:
            return None
        n = self._piece_len(req, cached, budget)
        pending = self._pending_rows()
        if cached + n < req.num_tokens and pending:
            return None
        if self.running and not self._width_fits(rows, req.num_tokens, *pending):
            return None   # in pieces or not, it joins the decode caches at this length
        # Headroom for the running rows' next tokens; never asked of a request alone.
        alone = not self.running
        loaded = cached - len(prefix)   # read from disk into new slots
        need = self.kv.room(loaded + n, len(prefix)) + \
            (0 if alone else self.limits.decode_headroom * (len(rows) + 1))
        # window slots for both parts, and one per decoding row
        windows = self.kv.window_need(loaded) + self.kv.window_need(n) + len(rows)
        self.kv.attach_prefix(req, prefix, node)   # locks the prefix against eviction
        if not self.kv.can_have(0, windows, slots=need) or not self.kv.take_state(req) or \
                not self.kv.make_room(0, windows, slots=need):
            self.kv.release(req, keep=False)
            return None
        self.waiting.remove(req)
        req.status = Status.PREFILLING
        if req.cached_tokens is None:   # (a request resumed here counts its prompt's)
            req.cached_tokens = min(cached, len(req.prompt_ids))
            req.disk_tokens = min(loaded, req.cached_tokens)
            if self.kv.disk is not None:
                self.kv.disk.hit_tokens += loaded
        self.running[req.rid] = req
        return self._prefill_input(req, loaded + n, hit)

    def _disk_hit(self, req: Request, prefix: list[int], node) -> DiskHit | None:
        """How far the disk tier continues the request's cached prefix."""
        if self.kv.disk is None:
            return None
        if req.hash_key != req.num_tokens:   # its block hashes, once per admission length
            req.hashes, req.hash_key = block_hashes(req.all_ids), req.num_tokens
        windows = self.kv.tree.path_windows(node) if self.kv.window and prefix else []
        return self.kv.disk.match(req.hashes, len(prefix), req.num_tokens - 1, windows)

    def _resume_cut(self, start: int, n: int, end: int) -> int:
        """With a disk tier, a window or recurrent model's prefill of its last piece
        stops at the last block boundary before it and computes the rest next step:
        the tree then holds what resuming there needs (the window's KV, the state),
        and so does the disk, so the same prompt can be read back up to it."""
        if self.kv.disk is None or not (self.kv.window or self.kv.needs_state) or \
                start + n != end:
            return n
        cut = (end - 1) // PREFIX_BLOCK * PREFIX_BLOCK
        return cut - start if cut > start else n

    def _prefill_input(self, req: Request, n: int, hit: DiskHit | None = None) -> PrefillInput:
        """The request's next `n` input tokens, after the KV it has (its cached
        prefix or earlier chunks); with a disk `hit`, the first of them read from
        disk if the worker can."""
        start = len(req.slot_ids)
        prefix_slots = list(req.slot_ids)
        # what is read from disk, then what is computed: the window before the first
        # computed token gets window slots too (the entry's window tail fills them)
        loaded = hit.end - start if hit is not None else 0
        new_slots = self.kv.extend(req, loaded, window_keep=self.kv.window) + \
            self.kv.extend(req, n - loaded)
        done = not req.behind
        if done:   # its last piece: the worker makes its decode row
            req.status = Status.RUNNING
        p = PrefillInput(req.rid, req.all_ids[start:len(req.slot_ids)], prefix_slots,
                         new_slots, req.sampling, needs_logits=done,
                         num_generated=len(req.output_ids))
        if hit is not None:
            p.disk_runs, p.disk_start, p.disk_tokens = hit.runs, hit.start, hit.end - start
        if self.kv.window:
            p.prefix_window_ids = self.kv.windows_read(req, start)
            p.new_window_ids = req.window_ids[start:]
        if req.state_slot:
            # the state the prefix ends at (a snapshot, or the working slot after a
            # chunk); the state after this piece goes to the working slot if another
            # chunk follows, and to a snapshot slot the tree takes with the KV
            p.state_from = req.state_from if start else 0
            p.state_slot = 0 if done else req.state_slot
            p.snapshot_slot = self.kv.take_snapshot(req)
            p.disk_state_slot = req.state_slot if hit is not None else 0
            req.state_from = req.state_slot
        if done:
            _add_sampling_context(p, req)
        return p

    # ---- finishing ---------------------------------------------------------------

    def _reject_reason(self, msg: TokenizedRequest) -> str | None:
        n = len(msg.input_ids)
        if n == 0:
            return "the prompt is empty"
        error = length_error(n, msg.max_new_tokens, self.limits.max_context,
                             self.limits.kv_capacity)
        if error:
            return error
        if msg.rid in self.running or self.waiting.find(msg.rid) is not None:
            return f"request id {msg.rid} is already in use"
        vocab = self.limits.vocab_size
        ids = msg.input_ids + msg.output_ids
        if vocab and not (0 <= min(ids) and max(ids) < vocab):
            return f"the prompt has token ids outside the model's vocabulary [0, {vocab})"
        if len(msg.output_ids) >= max_new_tokens(n, msg.max_new_tokens,
                                                 self.limits.max_context):
            return "a resumed request has no tokens left to generate"
        if any(p.offset > n for p in msg.pin):
            return "a cache_control pin ends past the end of the prompt"
        if msg.sampling.grammar is not None and not self.limits.constraints:
            return ("this model's worker cannot run constrained requests (llguidance "
                    "cannot read its tokenizer): send it without response_format or a "
                    "required tool call")
        return None

    def _finish(self, req: Request, reason: str, entry: TokenEntry, keep_kv: bool = True) -> None:
        del self.running[req.rid]
        req.status = Status.FINISHED
        self.spec.forget(req.rid)
        self.kv.release(req, keep=keep_kv)
        self._releases.append(req.rid)
        entry.finish_reason = reason
        entry.usage = req.usage()
        self._outbox.append(entry)


def _add_sampling_context(p: PrefillInput, req: Request) -> None:
    """What the worker's penalties, grammar and min_tokens need to know of the request, sent
    with its last chunk (again when it resumes after a retraction): the worker keeps
    no state of a request it released."""
    sampling = req.sampling
    if sampling.penalises_repeats:
        p.prompt_tail = req.prompt_ids[-REPETITION_CONTEXT:]
    if sampling.needs_output_ids:
        p.output_ids = list(req.output_ids)
    if sampling.holds_stops(len(req.output_ids)):
        p.stop_token_ids = sorted(req.stop_token_ids)
