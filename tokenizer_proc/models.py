"""The models the front end serves by name, and which of them to load and unload (pure:
no sockets, no asyncio; the clock is given).

Each served model has its own TokenizerCore (its tokenizer, chat template, request
state) and its own EngineSet (its engines and their router): rids are per core, so
engine sets never mix them. A model is `unloaded`, `loading` (its engines asked for,
none joined yet), `loaded`, or `unloading` (its running requests finishing before its
engines are stopped), or `failed` (its last load failed: no engines, and its next
request loads it again). While it is neither unloaded nor failed it counts its memory
against the budget (`--models-memory`); `plan_load` says which loaded models to unload
first (least recently used, never a pinned one).
"""

from dataclasses import dataclass, field

from mlxd.runtime.model_catalog import Catalog, ModelEntry

from .core import TokenizerCore
from .engines import EngineSet

LOADED, LOADING, UNLOADING, UNLOADED = "loaded", "loading", "unloading", "unloaded"
FAILED = "failed"
STATES = (LOADED, LOADING, UNLOADING, UNLOADED, FAILED)
DOWN = (UNLOADED, FAILED)   # no engines, no memory held: a request for it loads it
ID_SPACE = 1 << 40   # model k's core numbers its rids and queries from k * ID_SPACE + 1


def not_served(name: str | None, names: list[str]) -> str:
    """What a client asking for a model that is not served is told."""
    return (f"the model {name!r} does not exist; this server serves "
            f"{', '.join(map(repr, names))}")


def first_id(index: int) -> int:
    """Where the core of the `index`-th model starts its ids: every model's ids are
    its own, so an id names its model (`ModelTable.owner`)."""
    return index * ID_SPACE + 1


@dataclass(eq=False)
class Served:
    entry: ModelEntry
    core: TokenizerCore
    engines: EngineSet
    memory_gb: float
    state: str = UNLOADED
    last_used: float = 0.0          # when a request last asked for it
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)   # by reason
    failures: int = 0               # loads that failed
    failure: str = ""               # why the last one failed

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def busy(self) -> int:
        """Its requests not finished (sent to its engines, or parked waiting for one)."""
        return sum(e.load for e in self.engines.engines.values()) + self.engines.parked

    def card(self) -> dict:
        """What `/v1/models` says of it beyond OpenAI's fields."""
        card = {"state": self.state, "aliases": list(self.entry.aliases),
                "pinned": self.entry.pinned, "replicas": self.entry.replicas,
                "engines": len(self.engines.engines), "memory_gb": round(self.memory_gb, 3)}
        return {**card, "failure": self.failure} if self.state == FAILED else card


class ModelTable:
    def __init__(self, served: list[Served], budget_gb: float = 0.0):
        assert served, "a front end serves at least one model"
        self.models = served
        self.budget_gb = budget_gb
        self._by_name = {n: s for s in served for n in s.entry.names}

    @classmethod
    def of(cls, catalog: Catalog, make) -> "ModelTable":
        """The table of `catalog`'s models; `make(index, entry)` -> (core, engine set),
        the core numbering its ids from `first_id(index)`."""
        served = [Served(e, *make(i, e), catalog.memory_of(e))
                  for i, e in enumerate(catalog.entries)]
        return cls(served, catalog.budget_gb)

    @property
    def first(self) -> Served:
        return self.models[0]

    def find(self, name: str | None) -> Served | None:
        """The model `name` (or an alias) names; None: the first."""
        return self.first if name is None else self._by_name.get(name)

    def owner(self, rid: int) -> Served:
        """The model whose core made `rid` (a rid or a stats query id)."""
        return self.models[min(rid // ID_SPACE, len(self.models) - 1)]

    def names(self) -> list[str]:
        return [s.name for s in self.models]

    def used_gb(self) -> float:
        return sum(s.memory_gb for s in self.models if s.state not in DOWN)

    def plan_load(self, target: Served) -> list[Served] | None:
        """The loaded models to unload (least recently used first) so that `target`
        fits the budget; None when it cannot fit now (what would have to go is
        pinned, loading or unloading already)."""
        if target.state not in DOWN or not self.budget_gb:
            return []
        need = self.used_gb() + target.memory_gb - self.budget_gb
        victims: list[Served] = []
        candidates = sorted((s for s in self.models if s.state == LOADED
                             and not s.entry.pinned and s is not target),
                            key=lambda s: s.last_used)
        for s in candidates:
            if need <= 1e-9:
                break
            victims.append(s)
            need -= s.memory_gb
        return victims if need <= 1e-9 else None

    def idle(self, now: float, seconds: float) -> list[Served]:
        """Loaded, unpinned models with nothing running and no request for `seconds`."""
        if not seconds:
            return []
        return [s for s in self.models if s.state == LOADED and not s.entry.pinned
                and not s.busy and now - s.last_used >= seconds]

    def engine_model(self, engine: str) -> Served | None:
        """The model whose engine set holds `engine`."""
        return next((s for s in self.models if engine in s.engines.engines), None)
