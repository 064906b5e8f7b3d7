"""tokenizer_proc/models.py and model_loader.py: which models to unload for a load (LRU,
never pinned), idle models, ids that name their model, and the loader's states on the
event loop with a scripted host in place of the tokenizer process and the launcher
(failed loads: reported, or past the ready timeout, then tried again)."""

import asyncio
from types import SimpleNamespace

import pytest

from mlxd.protocol import SamplingParams, SchedulerReady, TokenizedRequest
from mlxd.runtime.model_catalog import Catalog, ModelEntry
from mlxd.tokenizer_proc.engines import EngineSet
from mlxd.tokenizer_proc.model_loader import LoadFailed, ModelLoader, ModelUnavailable
from mlxd.tokenizer_proc.models import (FAILED, ID_SPACE, LOADED, LOADING, UNLOADED,
                                        UNLOADING, ModelTable, Served, first_id)
from support import worker_limits


def table(*specs, budget: float = 0.0) -> ModelTable:
    """specs: (name, memory_gb, pinned, state, last_used)."""
    served = [Served(ModelEntry(name, name, pinned=pinned), SimpleNamespace(), EngineSet(),
                     gb, state, used)
              for name, gb, pinned, state, used in specs]
    return ModelTable(served, budget)


def running(served: Served) -> Served:
    """`served` with an engine and one request running on it."""
    served.engines.join("e0", SchedulerReady(worker_limits(), 8))
    served.engines.dispatch([TokenizedRequest(first_id(0), [1, 2], SamplingParams(), 4, [])])
    return served


def names(models) -> list[str] | None:
    return None if models is None else [m.name for m in models]


def test_a_load_unloads_the_least_recently_used_unpinned_models_that_make_room():
    t = table(("a", 2.0, False, LOADED, 30.0), ("b", 2.0, False, LOADED, 10.0),
              ("c", 2.0, False, LOADED, 20.0), ("p", 1.0, True, LOADED, 0.0),
              ("new", 3.0, False, UNLOADED, 0.0), budget=8.0)
    assert names(t.plan_load(t.find("new"))) == ["b"]   # 7 + 3 - 8 = 2 GiB: b's
    t.find("new").memory_gb = 5.0
    assert names(t.plan_load(t.find("new"))) == ["b", "c"]   # 4 GiB: b, then c
    t.find("b").state = UNLOADING
    # b's memory is held until it is gone (and promised to whoever unloaded it)
    assert names(t.plan_load(t.find("new"))) == ["c", "a"]


def test_a_load_waits_when_only_pinned_or_busy_state_models_could_make_room():
    t = table(("p", 3.0, True, LOADED, 0.0), ("l", 2.0, False, LOADING, 0.0),
              ("new", 2.0, False, UNLOADED, 0.0), budget=5.0)
    assert t.plan_load(t.find("new")) is None
    assert t.plan_load(t.find("p")) == []          # loaded already: nothing to do
    assert table(("a", 5.0, False, LOADED, 0.0), ("b", 5.0, False, UNLOADED, 0.0)) \
        .plan_load(table(("b", 5.0, False, UNLOADED, 0.0)).first) == []   # no budget


def test_idle_models_are_loaded_unpinned_without_requests_for_the_given_time():
    t = table(("a", 1.0, False, LOADED, 0.0), ("p", 1.0, True, LOADED, 0.0),
              ("b", 1.0, False, LOADED, 95.0), ("u", 1.0, False, UNLOADED, 0.0))
    assert names(t.idle(100.0, 10.0)) == ["a"]
    assert t.idle(100.0, 0.0) == []   # never
    assert running(t.find("a")).busy == 1 and t.idle(100.0, 10.0) == []


def test_every_models_ids_are_its_own():
    t = table(("a", 1.0, False, LOADED, 0.0), ("b", 1.0, False, LOADED, 0.0),
              ("c", 1.0, False, LOADED, 0.0))
    for k, served in enumerate(t.models):
        assert t.owner(first_id(k)) is served
        assert t.owner(first_id(k) + ID_SPACE - 2) is served
    assert t.find(None) is t.first and t.find("zz") is None


# ---- the loader ------------------------------------------------------------------

class Host:
    """Plays the tokenizer process: records controls and ended models; `joins` says
    which loads an engine answers (the launcher starting it)."""

    def __init__(self, t: ModelTable):
        self.table = t
        self.controls: list[tuple[str, str]] = []
        self.stopped: list[tuple[str, str]] = []
        self.answer_loads = True
        self.loader: ModelLoader | None = None

    def control(self, action: str, model: str) -> bool:
        self.controls.append((action, model))
        if action == "load" and self.answer_loads:   # its engine joins a moment later
            served = self.table.find(model)
            asyncio.get_running_loop().call_later(0.05, self.loader.joined, served)
        return True

    def stop_serving(self, served: Served, message: str) -> None:
        self.stopped.append((served.name, message))
        served.engines.retire_all()

    async def send(self) -> None:
        pass


def loader_for(t: ModelTable, **kw) -> tuple[ModelLoader, Host]:
    host = Host(t)
    host.loader = ModelLoader(t, host, **{"load_timeout": 2.0, "grace": 0.2, **kw})
    return host.loader, host


def two_models_one_fits() -> ModelTable:
    return table(("a", 1.0, False, LOADED, 0.0), ("b", 1.0, False, UNLOADED, 0.0),
                 budget=1.5)


def test_a_request_for_an_unloaded_model_unloads_the_lru_one_then_waits_for_the_load():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t)
        await asyncio.gather(loader.ready(t.find("b")), loader.ready(t.find("b")))
        assert host.controls == [("unload", "a"), ("load", "b")]   # one load for both
        assert (t.find("a").state, t.find("b").state) == (UNLOADED, LOADED)
        assert t.find("a").unloads == {"memory": 1} and t.find("b").loads == 1
        await loader.ready(t.find("a"))   # and back
        assert host.controls[2:] == [("unload", "b"), ("load", "a")]
    asyncio.run(run())


def test_running_requests_of_the_unloaded_model_finish_first_within_the_grace():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t, grace=5.0)
        a = running(t.find("a"))
        asyncio.get_running_loop().call_later(0.2, a.engines.retire_all)   # it finishes
        await loader.ready(t.find("b"))
        assert host.stopped == [("a", "the model 'a' was unloaded (memory) before the "
                                      "request finished")]
        assert host.controls == [("unload", "a"), ("load", "b")]
    asyncio.run(run())


def test_past_the_grace_the_running_requests_end_and_the_model_is_unloaded():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t, grace=0.1)
        a = running(t.find("a"))
        assert a.busy == 1
        await loader.ready(t.find("b"))
        assert a.busy == 0 and a.state == UNLOADED   # stop_serving ended it
    asyncio.run(run())


def test_a_load_that_does_not_come_is_a_503_then_fails_and_is_tried_again():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t, load_timeout=0.1, fail_after=0.25)
        host.answer_loads = False
        with pytest.raises(ModelUnavailable, match="'b' is not loaded yet") as caught:
            await loader.ready(t.find("b"))
        assert caught.value.retry_after > 0
        assert t.find("b").state == LOADING   # a slow load goes on
        await asyncio.sleep(0.2)
        with pytest.raises(ModelUnavailable):
            await loader.ready(t.find("b"))
        assert t.find("b").state == FAILED   # past fail_after: given up
        assert "no engine joined within 0.25 s (--ready-timeout)" in t.find("b").failure
        assert host.controls == [("unload", "a"), ("load", "b"), ("unload", "b")]
        host.answer_loads = True
        await loader.ready(t.find("b"))
        assert t.find("b").state == LOADED
    asyncio.run(run())


def test_unload_by_hand_and_a_second_unload_waits_for_the_first():
    async def run():
        t = table(("a", 1.0, True, LOADED, 0.0), ("b", 1.0, False, LOADED, 0.0))
        loader, host = loader_for(t)
        first, second = await asyncio.gather(loader.unload(t.find("a"), "admin"),
                                             loader.unload(t.find("a"), "admin"))
        assert (first, second) == (True, False) and t.find("a").state == UNLOADED
        assert await loader.unload(t.find("a"), "admin") is False
        assert t.find("a").unloads == {"admin": 1}
    asyncio.run(run())


def test_an_unload_during_a_load_cancels_it_and_a_waiting_request_loads_it_again():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t, grace=0.3)
        running(t.find("a"))
        waiting = asyncio.ensure_future(loader.ready(t.find("b")))
        await asyncio.sleep(0.05)   # b is loading, waiting for a to drain
        assert t.find("b").state == LOADING
        await loader.unload(t.find("b"), "admin")
        assert t.find("b").unloads == {"admin": 1}
        await asyncio.wait_for(waiting, 3)   # the request wanted it: loaded again, once
        assert host.controls == [("unload", "b"), ("load", "b"), ("unload", "a")] or \
            host.controls == [("unload", "b"), ("unload", "a"), ("load", "b")]
        assert t.find("b").state == LOADED
    asyncio.run(run())


def test_idle_models_are_unloaded_and_pinned_ones_never():
    async def run():
        clock = [0.0]
        t = table(("a", 1.0, False, LOADED, 0.0), ("p", 1.0, True, LOADED, 0.0))
        loader, host = loader_for(t, idle_seconds=0.08, clock=lambda: clock[0])
        watcher = asyncio.ensure_future(loader.watch())
        await asyncio.sleep(0.1)
        assert t.find("a").state == LOADED   # no time passed on the loader's clock
        clock[0] = 1.0
        await asyncio.sleep(0.15)
        watcher.cancel()
        assert (t.find("a").state, t.find("p").state) == (UNLOADED, LOADED)
        assert t.find("a").unloads == {"idle": 1}
    asyncio.run(run())


def test_the_models_started_with_the_server_are_loading_until_their_engine_joins():
    async def run():
        t = Catalog((ModelEntry("a", "a"), ModelEntry("b", "b")), at_start=("a",))
        served = ModelTable.of(t, lambda i, e: (SimpleNamespace(first=first_id(i)),
                                                EngineSet()))
        loader, host = loader_for(served)
        loader.started(t.at_start)
        assert [s.state for s in served.models] == [LOADING, UNLOADED]
        asyncio.get_running_loop().call_later(0.05, loader.joined, served.first)
        await loader.ready(served.first)
        assert served.first.loads == 1 and host.controls == []
        assert served.models[1].core.first == ID_SPACE + 1
    asyncio.run(run())


def test_a_reported_failure_ends_the_waiting_requests_at_once_and_the_next_one_retries():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t, load_timeout=30.0)
        host.answer_loads = False
        b = t.find("b")
        asyncio.get_running_loop().call_later(0.1, loader.failed, b, "its worker1 process "
                                              "exited with code 1: OSError: bad weights")
        waiting = await asyncio.wait_for(asyncio.gather(
            loader.ready(b), loader.ready(b), return_exceptions=True), 5)   # not 30 s
        for caught in waiting:
            assert isinstance(caught, LoadFailed) and caught.code == "model_load_failed"
            assert str(caught) == ("the model 'b' failed to load: its worker1 process "
                                   "exited with code 1: OSError: bad weights")
        assert (b.state, b.failures) == (FAILED, 1)
        assert b.card()["failure"].endswith("OSError: bad weights")
        assert t.used_gb() == 0.0 and t.plan_load(b) == []   # it holds no memory
        host.answer_loads = True
        await loader.ready(b)   # a later request loads it again
        assert host.controls == [("unload", "a"), ("load", "b"), ("load", "b")]
        assert b.state == LOADED and b.loads == 1 and "failure" not in b.card()
    asyncio.run(run())


def test_a_failure_reported_for_a_model_not_loading_is_ignored():
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t)
        running(t.find("a"))
        loader.failed(t.find("a"), "late")
        loader.failed(t.find("b"), "late")
        assert (t.find("a").state, t.find("b").state) == (LOADED, UNLOADED)
        assert t.find("a").failures == t.find("b").failures == 0
    asyncio.run(run())


def test_a_loaded_model_whose_engines_died_and_failed_to_restart_fails():
    """Its requests wait parked for an engine that will not come: they end, and the
    model's next request loads it again."""
    async def run():
        t = two_models_one_fits()
        loader, host = loader_for(t)
        a = running(t.find("a"))
        assert a.busy == 1
        a.engines.lost("e0")
        assert a.engines.parked == 1 and a.busy == 1   # parked requests are work
        loader.failed(a, "its scheduler process exited with code 1")
        assert a.state == FAILED and a.failures == 1 and a.engines.parked == 0
        assert "exited with code 1" in a.failure
    asyncio.run(run())


def test_without_a_launcher_a_load_fails_at_once():
    async def run():
        t = table(("a", 1.0, False, UNLOADED, 0.0))
        loader, host = loader_for(t, load_timeout=30.0)
        host.control = lambda action, model: False
        with pytest.raises(LoadFailed, match="'a' failed to load: no launcher"):
            await asyncio.wait_for(loader.ready(t.find("a")), 5)
        assert t.find("a").state == FAILED
    asyncio.run(run())
