"""The scheduler process: a thin socket loop around the pure Scheduler.

Sockets (each process binds what it receives on; the front end's is the exception,
so that engines can join it):
  frontend_addr       DEALER  TokenizedRequest / Abort / GetStats in; SchedulerReady,
                              then TokenBatch / Stats out (frontend_link.py)
  worker_output_addr  PULL    WorkerReady, then StepResult / WorkerError from the worker
  worker_input_addr   PUSH    one Step at a time to the worker (monitored: worker_link.py)
  ready_addr          PUSH    Ready to the launcher (optional)

When the worker dies, its running requests fail and the loop waits for the next
worker's WorkerReady (the launcher starts one) before it sends another Step. When the
front end's connection ends, every request is aborted; when one starts again, the
engine announces itself (SchedulerReady and its whole prefix cache) anew.
"""

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar

import zmq

from mlxd.protocol import (
    Abort, Decoder, GetStats, Ready, SchedulerReady, Stats, StepResult,
    StepTiming, TokenBatch, TokenizedRequest, WorkerError, WorkerLimits, WorkerReady, encode,
)
from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import SCHEDULER, ServerFlags
from mlxd.runtime.keys import read_secret_key
from mlxd.runtime.lifecycle import (
    Shutdown, die_with_parent, drain, install_signal_handlers, setup_logging,
)
from mlxd.runtime.sockets import (
    bind_pull, close_all, connect_push, decode_from, waking_receiver,
)

from .frontend_link import FrontendLink

from .scheduler import Scheduler, SchedulerLimits
from .speculation import SpecConfig
from .step_timing import StepTimings
from .worker_link import WorkerLink, replacement_mismatch

log = logging.getLogger("mlxd.scheduler")
# Multiplies every cache_control TTL: tests set it to see 5-minute pins end in seconds.
PIN_TTL_SCALE_ENV = "MLXD_PIN_TTL_SCALE"


@dataclass(frozen=True)
class SchedulerConfig:
    PROCESS: ClassVar[str] = SCHEDULER
    frontend_addr: str
    worker_input_addr: str
    worker_output_addr: str
    ready_addr: str = ""
    engine: str = "engine0"   # the engine's name: its routing id at the front end
    name: str = SCHEDULER     # in its Ready to the launcher (one per engine)
    model_name: str = ""      # the model's name at the front end ("": its first model)
    worker_ranks: int = 1     # the worker's tensor-parallel ranks: each gets every Step
    rank_addrs: str = ""      # ranks 1.. on other machines (tcp, comma-separated); "": local
    flags: ServerFlags = field(default_factory=ServerFlags)   # those used_by the scheduler
    parent_pid: int = 0


class SchedulerLoop:
    def __init__(self, cfg: SchedulerConfig, ctx: zmq.Context, wakeup=None):
        self.cfg = cfg
        self.wakeup = wakeup   # readable when a signal arrives (see runtime.lifecycle)
        self.frontend = FrontendLink(ctx, cfg.frontend_addr, cfg.engine, frontend_curve(cfg))
        self.from_worker = bind_pull(ctx, cfg.worker_output_addr)
        remote = [a for a in cfg.rank_addrs.split(",") if a]
        self.link = WorkerLink(ctx, cfg.worker_input_addr, cfg.worker_ranks, remote,
                               read_secret_key(cfg.flags.curve_secret_key) if remote else None)
        self.to_launcher = connect_push(ctx, cfg.ready_addr) if cfg.ready_addr else None
        self.poller = zmq.Poller()         # run() registers the inputs
        self.request_decoder = Decoder(TokenizedRequest, Abort, GetStats)
        self.worker_decoder = Decoder(StepResult, WorkerError, WorkerReady)
        self.scheduler: Scheduler | None = None
        self.in_flight: int | None = None   # step_id sent and not yet answered
        self.sent_at = 0.0                  # when it was sent (time.monotonic)
        self.abandoned = False              # it outlived worker_timeout: its requests failed
        self.restarting = False             # the worker died; no Step until a new one is ready
        self.worker_restarts = 0            # deaths of the worker noticed so far
        self.worker_limits: WorkerLimits | None = None
        self.worker_memory: dict = {}       # the latest step's memory figures
        self.timings = StepTimings()
        self.rejoin = False   # the front end's connection ended: announce on the next
        self._answered: tuple[float, StepTiming] | None = None   # (received at, worker's)

    @property
    def sockets(self):
        return [self.frontend.monitor, self.frontend.sock, self.from_worker,
                *self.link.monitors, *self.link.socks, self.to_launcher]

    def start(self) -> None:
        """Wait for the worker's WorkerReady, then announce ourselves: its limits to
        the tokenizer (SchedulerReady), and Ready to the launcher."""
        recv = (waking_receiver(self.from_worker, self.wakeup) if self.wakeup
                else self.from_worker.recv)
        while True:
            msg = decode_from(self.worker_decoder, recv(), "worker", log)
            if isinstance(msg, WorkerReady):
                break
            log.error("waiting for the worker's Ready; ignored %r", msg)
        self.worker_limits = msg.limits
        self.scheduler = Scheduler(scheduler_limits(self.cfg.flags, self.worker_limits))
        self._announce()
        if self.to_launcher:
            self.to_launcher.send(encode(Ready(self.cfg.name)))
        log.info("ready: kv_capacity=%d max_context=%d", self.worker_limits.kv_capacity,
                 self.worker_limits.max_context)

    def _announce(self) -> None:
        """Join the front end: the worker's limits, then (with the next batch) the
        whole prefix cache."""
        self.frontend.send(encode(SchedulerReady(
            self.worker_limits, self.cfg.flags.max_running_requests, self.cfg.model_name,
            os.getpid())))
        self.scheduler.announce_cache()

    def _on_frontend_events(self) -> None:
        for event in self.frontend.events():
            if event == "ended":
                # (a server stopping stops its front end first: no request, no alarm)
                requests = len(self.scheduler.running) + len(self.scheduler.waiting)
                log.log(logging.WARNING if requests else logging.INFO,
                        "the front end's connection ended; %d requests aborted", requests)
                self.scheduler.abort_all()
                # their abort entries would reach the next front end, which may have
                # sent the same rids here again (resumed): nobody is to see them
                self.scheduler.take_outputs()
                self.rejoin = True
            elif self.rejoin:
                log.info("the front end's connection started again; joining it")
                self.rejoin = False
                self._announce()

    def run(self) -> None:
        for sock in (self.frontend.sock, self.frontend.monitor, self.from_worker,
                     *self.link.monitors, self.wakeup):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)
        stalled = False   # the last schedule() had nothing to send: wait for input
        while True:
            # 1. receive: block only when there is no step to build
            busy = self._worker_free and self.scheduler.has_work and not stalled
            events = dict(self.poller.poll(0 if busy else self._watchdog_ms()))
            polled_at = time.perf_counter()
            if any(m in events for m in self.link.monitors) and self.link.lost():
                # (before its last answers)
                self._on_worker_lost()
            if self.frontend.monitor in events:
                self._on_frontend_events()
            if self.frontend.sock in events:
                self._drain_requests()
            if self.from_worker in events:
                self._drain_worker(polled_at)
            if self.wakeup in events:
                drain(self.wakeup)   # the signal's handler raises Shutdown
            self._watch_worker()
            # 2. schedule and send the next step as soon as the worker is free
            if self._worker_free:
                step = self.scheduler.schedule()
                stalled = step is None
                if step is not None:
                    self.link.send(encode(step))
                    self.in_flight, self.sent_at = step.step_id, time.monotonic()
                self._record_timing()
            # 3. stream everything this iteration produced, in one message, with
            # what the prefix cache stored and removed
            entries = self.scheduler.take_outputs()
            if entries or self.scheduler.has_cache_events:
                self.frontend.send(encode(TokenBatch(entries,
                                                     **self.scheduler.take_cache_events())))

    def _drain_requests(self) -> None:
        while (frame := self.frontend.recv_nowait()) is not None:
            msg = decode_from(self.request_decoder, frame, "front end", log)
            if isinstance(msg, TokenizedRequest):
                self.scheduler.add_request(msg)
            elif isinstance(msg, Abort):
                self.scheduler.abort(msg.rid)
            elif isinstance(msg, GetStats):
                stats = {**self.scheduler.stats(), **self._worker_status(),
                         "worker": {**self.worker_limits.as_dict(), **self.worker_memory},
                         "timing": self.timings.summary()}
                self.frontend.send(encode(Stats(msg.query_id, stats)))

    def _drain_worker(self, polled_at: float) -> None:
        while True:
            try:
                frame = self.from_worker.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode_from(self.worker_decoder, frame, "worker", log)
            if isinstance(msg, WorkerReady):
                self._on_worker_ready(msg)
            elif isinstance(msg, (StepResult, WorkerError)) and self._answers_in_flight(msg):
                self.in_flight = None
                if self.abandoned:   # its requests already failed; the next Step releases them
                    self.abandoned = False
                    log.warning("the worker answered step %d after %.1f s; answer dropped",
                                msg.step_id, time.monotonic() - self.sent_at)
                elif isinstance(msg, StepResult):
                    self._answered = (polled_at, msg.timing)
                    self.worker_memory = {"active_memory": msg.timing.active_memory,
                                          "peak_memory": msg.timing.peak_memory}
                    self.scheduler.process_result(msg)
                else:
                    log.error("worker failed step %d: %s", msg.step_id, msg.message)
                    self.scheduler.fail_step(msg)

    @property
    def _worker_free(self) -> bool:
        """A Step may be sent: a worker is up and has no step to answer."""
        return self.in_flight is None and not self.restarting

    def _on_worker_lost(self) -> None:
        """The worker died: its running requests fail, its state is forgotten, and
        Steps wait for the next worker's WorkerReady."""
        if self.restarting:   # counted already: the dead worker's listener closing late
            log.debug("a lost connection while no worker serves (counted already)")
            return            # (a new worker dying while it loads stops the server)
        self.worker_restarts += 1
        log.error("the worker's socket closed: the worker died (death %d); running "
                  "requests resume, with waiting ones, on a new worker", self.worker_restarts)
        self.scheduler.reset_worker("the worker process died")
        self.restarting, self.in_flight, self.abandoned = True, None, False
        self._answered = None
        self.worker_memory = {}
        for monitor in self.link.monitors:
            self.poller.unregister(monitor)
        self.link.reopen()
        for monitor in self.link.monitors:
            self.poller.register(monitor, zmq.POLLIN)

    def _on_worker_ready(self, msg: WorkerReady) -> None:
        """A new worker, empty, takes the dead one's place under the same limits."""
        if not self.restarting:
            log.error("ignored a WorkerReady: the worker serving now is not new")
            return
        why = replacement_mismatch(self.worker_limits, msg.limits)
        if why:
            raise WorkerMismatch(why)
        self.restarting = False
        self.scheduler.disk_restarted(msg.limits.kv_disk_entries)
        log.warning("a new worker is ready (after %d deaths); serving again",
                    self.worker_restarts)

    def _watchdog_ms(self) -> int | None:
        """How long the poll may block: until the step in flight outlives the limit."""
        if self.in_flight is None or self.abandoned:
            return None
        left = self.sent_at + self.cfg.flags.worker_timeout - time.monotonic()
        return max(0, int(left * 1e3) + 1)

    def _watch_worker(self) -> None:
        """Past worker_timeout without an answer, fail the running requests; later
        Steps wait until the worker answers the abandoned one."""
        waited = time.monotonic() - self.sent_at
        if self.in_flight is None or self.abandoned or waited < self.cfg.flags.worker_timeout:
            return
        self.abandoned = True
        message = (f"the worker did not answer step {self.in_flight} within "
                   f"{self.cfg.flags.worker_timeout:g} s (--worker-timeout); it is unresponsive")
        log.error(message)
        self.scheduler.abandon_step(WorkerError(self.in_flight, message))

    def _worker_status(self) -> dict:
        waited = time.monotonic() - self.sent_at if self.in_flight is not None else 0.0
        status = ("restarting" if self.restarting else
                  "unresponsive" if self.abandoned else "ok")
        return {"worker_status": status, "worker_step_seconds": round(waited, 3),
                "worker_restarts": self.worker_restarts}

    def _record_timing(self) -> None:
        """Scheduler time of a step: from its result's arrival to the next Step sent."""
        if self._answered is not None:
            received_at, worker_timing = self._answered
            self._answered = None
            self.timings.record(worker_timing, (time.perf_counter() - received_at) * 1e3)

    def _answers_in_flight(self, msg) -> bool:
        if msg.step_id == self.in_flight:
            return True
        log.error("dropped the worker's answer to step %d; step %s is in flight",
                  msg.step_id, self.in_flight)
        return False



class WorkerMismatch(RuntimeError):
    """A restarted worker cannot replace the first one: the scheduler stops (and
    with it the server)."""


def scheduler_limits(flags: ServerFlags, worker: WorkerLimits) -> SchedulerLimits:
    """The scheduler's limits: the worker's memory and model, the user's flags."""
    return SchedulerLimits(
        kv_capacity=worker.kv_capacity, max_context=worker.max_context,
        max_running_requests=flags.max_running_requests,
        max_prefill_tokens=flags.max_prefill_tokens,
        chunked_prefill_size=flags.chunked_prefill_size,
        disable_radix_cache=flags.disable_radix_cache,
        decode_cache_tokens=worker.decode_cache_tokens, vocab_size=worker.vocab_size,
        state_slots=worker.state_slots, snapshot_slots=worker.snapshot_slots,
        window_capacity=worker.window_capacity, window=max(worker.window_sizes, default=0),
        decode_page=worker.decode_page, max_pinned_tokens=flags.max_pinned_tokens,
        pin_ttl_scale=pin_ttl_scale(),
        speculative=SpecConfig(flags.speculative, flags.spec_max_draft, flags.spec_ngram_min,
                               flags.spec_ngram_max, flags.spec_max_batch),
        verifies_drafts=worker.verifies_drafts, worker_overlaps=worker.overlap,
        verify_costs=tuple(worker.verify_costs), draft_model=bool(worker.draft_model),
        draft_cost=worker.draft_cost, constraints=worker.constraints,
        kv_disk=worker.kv_disk, kv_disk_entries=tuple(worker.kv_disk_entries))


def frontend_curve(cfg: SchedulerConfig):
    """The front end's key pair, for a link over tcp (an engine on another machine);
    None on this machine's ipc."""
    if not cfg.frontend_addr.startswith("tcp://"):
        return None
    if not cfg.flags.curve_secret_key:
        raise SystemExit("mlxd scheduler: joining a front end over tcp needs "
                         "--curve-secret-key (the front end's key file)")
    return read_secret_key(cfg.flags.curve_secret_key)


def pin_ttl_scale() -> float:
    """MLXD_PIN_TTL_SCALE (a positive finite number; 1 when unset or not one)."""
    try:
        scale = float(os.environ.get(PIN_TTL_SCALE_ENV, "1"))
    except ValueError:
        scale = 1.0
    return scale if math.isfinite(scale) and scale > 0 else 1.0


def main(argv=None) -> None:
    cfg = parse_config(SchedulerConfig, "mlxd scheduler process", argv)
    setup_logging("scheduler", cfg.flags.log_level)
    die_with_parent(cfg.parent_pid)
    wakeup = install_signal_handlers()
    ctx = zmq.Context()
    loop = SchedulerLoop(cfg, ctx, wakeup)
    try:
        loop.start()
        loop.run()
    except Shutdown as why:
        log.info("shutting down (%s)", why)
    except WorkerMismatch as why:
        log.error("stopping: %s", why)
        raise SystemExit(1)
    finally:
        close_all(ctx, *loop.sockets)
