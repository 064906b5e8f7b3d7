"""The models one server serves by name: `--model` given several times, or a
`--models FILE`; read by the launcher (which starts and stops each model's engines)
and by the front end (which keeps a tokenizer and an engine set per model).

A models file is TOML (`[[models]]` tables) or JSON (a list, or `{"models": [...]}`),
one entry per model:

    name       the name requests ask for (`model` in OpenAI / Anthropic / the SDK)
    model      what `--model` would take: a folder, a GGUF file, a hub id, `ollama:...`
    aliases    other names for it (e.g. "gpt-4o-mini", so clients with a fixed name work)
    replicas   engines of it on this machine (as `--dp`)
    pinned     never unloaded (neither for memory nor when idle)
    memory_gb  its workers' memory limit, all replicas together; 0: an equal share of
               the server's memory limit (`--mem-limit-gb`, else `--mem-fraction`)

The launcher resolves every entry to a folder at start and hands the front end the
result as a JSON file (`Catalog.dump` / `Catalog.load`).
"""

import json
import os
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ENTRY_KEYS = {"name", "model", "aliases", "replicas", "pinned", "memory_gb"}


class CatalogError(ValueError):
    """A models file or `--model` list that cannot be served; the message says why."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    model: str                       # as given (a `--model` value)
    aliases: tuple[str, ...] = ()
    replicas: int = 1
    pinned: bool = False
    memory_gb: float = 0.0           # 0: an equal share (see `memory_of`)
    path: str = ""                   # the resolved folder (set by the launcher)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class Catalog:
    entries: tuple[ModelEntry, ...]
    budget_gb: float = 0.0           # --models-memory; 0: no budget
    limit_gb: float = 0.0            # the server's memory limit, shared by default
    at_start: tuple[str, ...] = field(default=())   # models loaded when the server starts

    def entry(self, name: str) -> ModelEntry | None:
        return next((e for e in self.entries if name in e.names), None)

    def memory_of(self, entry: ModelEntry) -> float:
        """What `entry`'s workers may use in all (GiB): its own figure, else an equal
        share of the memory limit."""
        return entry.memory_gb or self.limit_gb / len(self.entries)

    def dump(self, path: str) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str) -> "Catalog":
        raw = json.loads(Path(path).read_text())
        entries = tuple(ModelEntry(**{**e, "aliases": tuple(e["aliases"])})
                        for e in raw["entries"])
        return cls(entries, raw["budget_gb"], raw["limit_gb"], tuple(raw["at_start"]))


def read_models_file(path: str, replicas: int = 1) -> list[ModelEntry]:
    """The entries of a models file (TOML by its `.toml` suffix, else JSON);
    `replicas` where an entry does not say."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CatalogError(f"--models {path}: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except ValueError as exc:   # TOMLDecodeError and JSONDecodeError both are
        raise CatalogError(f"--models {path}: not valid "
                           f"{'TOML' if path.endswith('.toml') else 'JSON'}: {exc}") from None
    items = raw.get("models") if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not items:
        raise CatalogError(f"--models {path}: expected a non-empty list of models "
                           "(JSON: [...] or {\"models\": [...]}; TOML: [[models]] tables)")
    return [_entry(item, f"--models {path}, entry {i + 1}", replicas)
            for i, item in enumerate(items)]


def _entry(item, where: str, replicas: int) -> ModelEntry:
    if not isinstance(item, dict):
        raise CatalogError(f"{where}: expected a table of {sorted(ENTRY_KEYS)}")
    unknown = set(item) - ENTRY_KEYS
    if unknown:
        raise CatalogError(f"{where}: unknown keys {sorted(unknown)}; an entry has "
                           f"{sorted(ENTRY_KEYS)}")
    checks = {"name": str, "model": str, "replicas": int, "pinned": bool,
              "memory_gb": (int, float), "aliases": list}
    for key, kind in checks.items():
        if key in item and (not isinstance(item[key], kind) or
                            (kind is int and isinstance(item[key], bool))):
            raise CatalogError(f"{where}: {key} has the wrong type ({item[key]!r})")
    if not item.get("model") and "name" not in item:
        raise CatalogError(f"{where}: give at least `model` (or `name` for the default "
                           "model)")
    aliases = item.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise CatalogError(f"{where}: aliases must be non-empty strings")
    if item.get("replicas", 1) < 1 or item.get("memory_gb", 0) < 0:
        raise CatalogError(f"{where}: replicas must be >= 1 and memory_gb >= 0")
    return ModelEntry(name=item.get("name", ""), model=item.get("model", ""),
                      aliases=tuple(aliases), replicas=item.get("replicas", replicas),
                      pinned=item.get("pinned", False),
                      memory_gb=float(item.get("memory_gb", 0.0)))


def check_names(entries: list[ModelEntry]) -> None:
    """Every name and alias names one model."""
    seen: dict[str, str] = {}
    for e in entries:
        if not e.name:
            raise CatalogError(f"the model {e.model!r} has no name")
        for n in e.names:
            if n in seen:
                raise CatalogError(f"the name {n!r} is given to two models "
                                   f"({seen[n]!r} and {e.model!r})")
            seen[n] = e.model


def models_at_start(entries: list[ModelEntry], catalog: Catalog) -> tuple[str, ...]:
    """The models loaded at start: pinned ones, then the others in the order given,
    while they fit the budget (all of them without one)."""
    order = [e for e in entries if e.pinned] + [e for e in entries if not e.pinned]
    chosen, used = [], 0.0
    for e in order:
        cost = catalog.memory_of(e)
        if e.pinned or not catalog.budget_gb or used + cost <= catalog.budget_gb + 1e-9:
            chosen.append(e.name)
            used += cost
    return tuple(chosen)


def total_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)


def build_catalog(entries: list[ModelEntry], budget_gb: float, mem_limit_gb: float,
                  mem_fraction: float) -> Catalog:
    """The catalog of resolved, named `entries`, with the models loaded at start."""
    check_names(entries)
    limit = mem_limit_gb or mem_fraction * total_memory_gb()
    catalog = Catalog(tuple(entries), budget_gb, limit)
    pinned = sum(catalog.memory_of(e) for e in entries if e.pinned)
    if budget_gb and pinned > budget_gb + 1e-9:
        raise CatalogError(f"the pinned models need {pinned:.2f} GiB, more than "
                           f"--models-memory {budget_gb:g}")
    too_big = [e.name for e in entries if budget_gb and catalog.memory_of(e) > budget_gb]
    if too_big:
        raise CatalogError(f"{', '.join(too_big)}: needs more than --models-memory "
                           f"{budget_gb:g} GiB alone")
    return replace(catalog, at_start=models_at_start(entries, catalog))
