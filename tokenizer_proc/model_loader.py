"""Loading and unloading served models on the front end's event loop.

The front end decides (models.ModelTable's plan), the launcher acts: `load` and
`unload` go to it as ModelControl messages, and a model counts as loaded when its
first engine joins. A request for a model that is not loaded waits in `ready`
(before admission: its limits are known only once an engine joined) for at most
`--model-load-timeout`, then gets ModelUnavailable (HTTP 503 with Retry-After). A
load fails when the launcher says so (`failed`: its worker died loading, its folder is
gone) or when no engine joined within `--ready-timeout`: the model is `failed`, the
requests waiting for that load get LoadFailed naming the cause at once, and the next
request tries again.
Unloading first stops new requests from reaching the model (they wait, and load it
again), lets its running requests finish for `--unload-grace-seconds`, ends the rest
with an error, then has the launcher stop its engines.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from mlxd.runtime.aio import TaskSet

from .models import DOWN, FAILED, LOADED, LOADING, UNLOADED, UNLOADING, ModelTable, Served

log = logging.getLogger("mlxd.tokenizer")

DRAIN_POLL_SECONDS = 0.05
STUCK_POLL_SECONDS = 1.0   # how often a load waiting for memory checks for failed loads
RETRY_AFTER_SECONDS = 5


class ModelUnavailable(Exception):
    """The model did not load in time; the client may retry after `retry_after` s."""

    code = "unavailable"

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_SECONDS):
        super().__init__(message)
        self.retry_after = retry_after


class LoadFailed(Exception):
    """The load the request waited for failed (the message names the model and the
    cause); a later request tries again."""

    code = "model_load_failed"

    def __init__(self, served: Served):
        super().__init__(f"the model {served.name!r} failed to load: {served.failure}")


@dataclass(eq=False)
class _Load:
    """A model's load in progress (each is a new object: a load started again is
    another one)."""

    started: float


class LoaderHost(Protocol):
    """What the loader needs of the tokenizer process."""

    def control(self, action: str, model: str) -> bool:
        """Ask the launcher to load or unload `model`; False: no launcher to ask."""
        ...

    def stop_serving(self, served: Served, message: str) -> None:
        """End `served`'s unfinished requests with `message`; take its engines out."""
        ...

    async def send(self) -> None:
        """Deliver what is queued (the ended requests' replies)."""
        ...


class ModelLoader:
    def __init__(self, table: ModelTable, host: LoaderHost, load_timeout: float,
                 grace: float, idle_seconds: float = 0.0, fail_after: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        """`load_timeout`: how long a request waits; `fail_after`: how long a load
        may take; `grace`: how long an unloaded model's requests may still run."""
        self.table, self.host = table, host
        self.load_timeout, self.grace, self.idle_seconds = load_timeout, grace, idle_seconds
        self.fail_after = fail_after
        self.clock = clock
        self._changed = asyncio.Event()   # replaced on every state change
        self._loads: dict[Served, _Load] = {}   # the loads in progress
        self._tasks = TaskSet()

    # ---- states ------------------------------------------------------------------

    def _set(self, served: Served, state: str) -> None:
        served.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    def started(self, names: tuple[str, ...]) -> None:
        """The models the launcher loads at start are loading."""
        for served in self.table.models:
            if served.name in names:
                self._set(served, LOADING)
                self._loads[served] = _Load(self.clock())

    def joined(self, served: Served) -> None:
        """An engine of `served` joined: it serves."""
        if served.state == LOADED:
            return
        if served.state == LOADING:
            served.loads += 1
            load = self._loads.pop(served, None)
            log.info("model %s loaded in %.1f s", served.name,
                     self.clock() - load.started if load else 0.0)
        self._set(served, LOADED)

    # ---- loading -----------------------------------------------------------------

    async def ready(self, served: Served) -> None:
        """Return once `served` is loaded (loading it, and unloading others to make
        room, if need be); ModelUnavailable past the load timeout, LoadFailed
        if the load failed meanwhile."""
        served.last_used = self.clock()
        if served.state == LOADED:
            return
        try:
            await asyncio.wait_for(self._until_loaded(served), self.load_timeout)
        except asyncio.TimeoutError:
            self._give_up_stuck_loads()
            raise ModelUnavailable(
                f"the model {served.name!r} is not loaded yet ({served.state}); "
                "retry later") from None
        served.last_used = self.clock()

    async def _until_loaded(self, served: Served) -> None:
        failures = served.failures   # a failure before we came is retried, not ours
        told = False
        while served.state != LOADED:
            if served.failures != failures:
                raise LoadFailed(served)
            changed = self._changed
            if served.state in DOWN:
                victims = self.table.plan_load(served)
                if victims is not None:
                    self._begin_load(served, victims)
                    continue
                if not told:
                    log.info("model %s waits for memory: %.2f of %.2f GiB are used by "
                             "models that cannot be unloaded now", served.name,
                             self.table.used_gb(), self.table.budget_gb)
                    told = True
                self._give_up_stuck_loads()   # a failed load holds memory until then
            try:
                await asyncio.wait_for(changed.wait(), STUCK_POLL_SECONDS)
            except asyncio.TimeoutError:
                pass

    def _begin_load(self, served: Served, victims: list[Served]) -> None:
        log.info("loading model %s (%.2f GiB)%s", served.name, served.memory_gb,
                 f"; first unloading {', '.join(v.name for v in victims)} (least recently "
                 "used)" if victims else "")
        for victim in victims:
            self._set(victim, UNLOADING)
        self._set(served, LOADING)
        load = self._loads[served] = _Load(self.clock())
        self._tasks.spawn(self._load(served, victims, load))

    async def _load(self, served: Served, victims: list[Served], load: _Load) -> None:
        await asyncio.gather(*(self._drain_and_stop(v, "memory") for v in victims))
        if served.state != LOADING or self._loads.get(served) is not load:
            return   # unloaded meanwhile (by an administrator), maybe loading anew
        if not self.host.control("load", served.name):
            self.failed(served, "no launcher to start its engines")

    def failed(self, served: Served, reason: str) -> None:
        """The launcher reports that `served`'s load failed (it stopped what it had
        started): its waiting requests end with `reason`, the next one tries again."""
        if served.state == LOADED and not served.engines.engines:
            # its only engine died serving and its restart failed: nothing will join
            log.error("model %s lost its engines and failed to restart: %s",
                      served.name, reason)
            self.host.stop_serving(served, f"the model {served.name!r} failed to "
                                           f"restart: {reason}")
            self._fail(served, reason)
            return
        if served.state != LOADING:   # a late report, for a load called off already
            log.warning("model %s: ignored a load failure while %s: %s", served.name,
                        served.state, reason)
            return
        log.info("model %s failed to load: %s", served.name, reason)
        self._fail(served, reason)

    def _fail(self, served: Served, reason: str) -> None:
        self._loads.pop(served, None)
        served.failures += 1
        served.failure = reason
        self._set(served, FAILED)

    def _give_up_stuck_loads(self) -> None:
        """A load that had no engine join within `fail_after` failed (its worker hangs
        loading, or never fits): its engines are stopped, the model is failed, and its
        next request tries again."""
        for served in self.table.models:
            load = self._loads.get(served)
            if served.state == LOADING and load is not None and \
                    self.clock() - load.started >= self.fail_after:
                self._give_up(served)

    def _give_up(self, served: Served) -> None:
        log.error("model %s did not load within %.0f s (--ready-timeout); its engines "
                  "are stopped", served.name, self.fail_after)
        self.host.stop_serving(served, f"the model {served.name!r} failed to load")
        self.host.control("unload", served.name)
        self._fail(served, f"no engine joined within {self.fail_after:g} s "
                           "(--ready-timeout)")

    # ---- unloading ---------------------------------------------------------------

    async def unload(self, served: Served, reason: str) -> bool:
        """Unload `served` (its running requests finish first, within the grace);
        False if it was not loaded (or loading)."""
        if served.state == UNLOADING:   # already going: once it is gone
            while served.state == UNLOADING:
                await self._changed.wait()
            return False
        if served.state in DOWN:
            return False
        self._loads.pop(served, None)   # a load in progress is called off
        self._set(served, UNLOADING)
        await self._drain_and_stop(served, reason)
        return True

    async def _drain_and_stop(self, served: Served, reason: str) -> None:
        deadline = self.clock() + self.grace
        while served.busy and self.clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if served.busy:
            log.warning("model %s: %d requests still running after %.0f s "
                        "(--unload-grace-seconds) end with an error", served.name,
                        served.busy, self.grace)
        self.host.stop_serving(served, f"the model {served.name!r} was unloaded "
                                       f"({reason}) before the request finished")
        await self.host.send()
        self.host.control("unload", served.name)
        served.unloads[reason] = served.unloads.get(reason, 0) + 1
        log.info("model %s unloaded (%s)", served.name, reason)
        self._set(served, UNLOADED)

    async def watch(self) -> None:
        """Now and then: give up loads that failed, unload models idle past
        `--unload-idle-seconds`."""
        period = min(STUCK_POLL_SECONDS, self.idle_seconds / 4 or STUCK_POLL_SECONDS)
        while True:
            await asyncio.sleep(period)
            self._give_up_stuck_loads()
            for served in self.table.idle(self.clock(), self.idle_seconds):
                self._set(served, UNLOADING)
                self._tasks.spawn(self._drain_and_stop(served, "idle"))
