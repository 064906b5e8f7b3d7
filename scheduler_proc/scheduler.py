"""The pure scheduler: no sockets, no MLX. Requests in, Steps out, results in, tokens out.

Admission is FCFS, bounded by --max-running-requests, a per-step prefill token
budget and the KV slots a request may need (its prompt plus max_new_tokens):
a running request can never run out of slots.
"""

from collections import deque
from dataclasses import dataclass

from protocol import PrefillInput, Step, StepResult, TokenEntry, TokenizedRequest, WorkerError

from .allocator import SlotAllocator
from .request import Request, Status


@dataclass(frozen=True)
class SchedulerLimits:
    kv_capacity: int
    max_context: int
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.allocator = SlotAllocator(limits.kv_capacity)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self._releases: list[int] = []
        self._outbox: list[TokenEntry] = []
        self._promised = 0   # slots running requests may still claim
        self._step_id = 0

    # ---- inputs -------------------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> None:
        error = self._reject_reason(msg)
        if error:
            self._outbox.append(TokenEntry(msg.rid, [], [], finish_reason="error", error=error))
            return
        limit = min(self.limits.max_context, self.limits.kv_capacity + 1)
        max_new = min(msg.max_new_tokens, limit - len(msg.input_ids))
        self.waiting.append(Request.from_message(msg, max_new))

    def abort(self, rid: int) -> None:
        if rid in self.running:
            self._finish(self.running[rid], "abort", TokenEntry(rid, [], []))
            return
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.status = Status.FINISHED
                self._outbox.append(TokenEntry(rid, [], [], finish_reason="abort",
                                               usage=req.usage()))
                return

    def process_result(self, result: StepResult) -> None:
        tops = result.top_logprobs or [None] * len(result.rids)
        for rid, token, logprob, top in zip(result.rids, result.tokens, result.logprobs, tops):
            req = self.running.get(rid)
            if req is None:   # finished or aborted while the step ran
                continue
            req.output_ids.append(token)
            entry = TokenEntry(rid, [token], [logprob], None if top is None else [top])
            reason = req.finish_reason_after(token)
            if reason:
                self._finish(req, reason, entry)
            else:
                self._outbox.append(entry)

    def fail_step(self, error: WorkerError) -> None:
        """The worker dropped every request's state: all running requests fail."""
        for req in list(self.running.values()):
            self._finish(req, "error", TokenEntry(req.rid, [], [], error=error.message))
        self._releases.clear()

    # ---- outputs ------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next Step, or None when there is nothing to send."""
        decode_rids = list(self.running)
        decode_slots = self.allocator.allocate(len(decode_rids))
        for rid, slot in zip(decode_rids, decode_slots):
            self.running[rid].slot_ids.append(slot)
        self._promised -= len(decode_slots)
        prefills = self._admit()
        if not (decode_rids or prefills or self._releases):
            return None
        releases, self._releases = self._releases, []
        self._step_id += 1
        return Step(self._step_id, decode_rids, decode_slots, prefills, releases)

    def take_outputs(self) -> list[TokenEntry]:
        out, self._outbox = self._outbox, []
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._releases)

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "free_slots": self.allocator.num_free, "used_slots": self.allocator.num_used}

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        held = sum(len(r.slot_ids) for r in self.running.values())
        assert held == self.allocator.num_used, f"{held} slots held, {self.allocator.num_used} used"
        assert self._promised == sum(r.kv_outstanding for r in self.running.values())
        assert self._promised <= self.allocator.num_free

    # ---- internals ----------------------------------------------------------

    def _reject_reason(self, msg: TokenizedRequest) -> str | None:
        n = len(msg.input_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.limits.max_context:
            return (f"the prompt has {n} tokens; the model's context is "
                    f"{self.limits.max_context} tokens")
        if n > self.limits.kv_capacity:
            return (f"the prompt has {n} tokens; the KV cache holds "
                    f"{self.limits.kv_capacity} tokens")
        if msg.rid in self.running or any(r.rid == msg.rid for r in self.waiting):
            return f"request id {msg.rid} is already in use"
        return None

    def _admit(self) -> list[PrefillInput]:
        prefills = []
        budget = self.limits.max_prefill_tokens
        while self.waiting and len(self.running) < self.limits.max_running_requests:
            req = self.waiting[0]
            n = len(req.prompt_ids)
            if prefills and n > budget:
                break
            if self.allocator.num_free - self._promised < req.kv_need:
                break
            self.waiting.popleft()
            req.slot_ids = self.allocator.allocate(n)
            req.status = Status.RUNNING
            self.running[req.rid] = req
            self._promised += req.kv_outstanding
            budget -= n
            prefills.append(PrefillInput(req.rid, req.prompt_ids, [], req.slot_ids,
                                         req.sampling))
        return prefills

    def _finish(self, req: Request, reason: str, entry: TokenEntry) -> None:
        del self.running[req.rid]
        req.status = Status.FINISHED
        self._promised -= req.kv_outstanding
        self.allocator.free(req.slot_ids)
        req.slot_ids = []
        self._releases.append(req.rid)
        entry.finish_reason = reason
        entry.usage = req.usage()
        self._outbox.append(entry)
