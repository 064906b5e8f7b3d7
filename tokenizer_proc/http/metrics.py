"""Prometheus metrics of the HTTP front end (`GET /metrics`), with prometheus_client
in a registry of the front end's own.

Counters and histograms are fed as requests run; the scheduler's counters (running,
waiting, KV slots, pinned slots and refused pins, retractions, step time, and the
speculative-decoding counters) are read from its stats at each scrape; with several
engines, the same gauges labelled by model and engine, and the router's decisions by
reason; with several models, each model's gauges and state."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlxd.protocol import StreamChunk

from ..engines import add_stats
from ..models import STATES
from ..router import REASONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# scheduler stats key -> gauge name, help
STATS_GAUGES = {
    "running": ("mlxd_requests_running", "requests being decoded"),
    "waiting": ("mlxd_requests_waiting", "requests waiting to run"),
    "used_slots": ("mlxd_kv_slots_used", "KV slots held by running requests"),
    "cached_slots": ("mlxd_kv_slots_cached", "KV slots in the prefix cache"),
    "capacity": ("mlxd_kv_slots_capacity", "KV pool size in tokens"),
    "retractions": ("mlxd_retractions", "requests retracted so far (KV ran out)"),
    "pinned_slots": ("mlxd_kv_slots_pinned", "KV slots pinned by cache_control breakpoints"),
    "max_pinned_slots": ("mlxd_kv_slots_pinned_max", "the most KV slots pins may hold "
                         "(--max-pinned-tokens)"),
    "pins_refused": ("mlxd_kv_pins_refused", "cache_control pins not taken so far: they "
                     "would have passed --max-pinned-tokens"),
}


# the scheduler's stats["speculative"] key -> counter name (`_total` added), help
SPEC_COUNTERS = {
    "verifies": ("mlxd_spec_verifies", "request-steps that verified a draft"),
    "draft_tokens": ("mlxd_spec_draft_tokens", "draft tokens proposed and verified"),
    "accepted_tokens": ("mlxd_spec_accepted_tokens", "draft tokens accepted"),
}


class _SpecCounters:
    """The scheduler's speculation counters as Prometheus counters, labelled by the
    drafting method, as of the latest stats."""

    def __init__(self):
        self.latest: dict = {}

    def collect(self):
        method = str(self.latest.get("method", "off"))
        for key, (name, text) in SPEC_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=["method"])
            value = self.latest.get(key, 0)
            family.add_metric([method], value if isinstance(value, (int, float)) else 0)
            yield family


# each engine's stats key -> gauge name (labelled by engine), help
ENGINE_GAUGES = {
    "running": ("mlxd_engine_requests_running", "requests being decoded, per engine"),
    "waiting": ("mlxd_engine_requests_waiting", "requests waiting to run, per engine"),
    "load": ("mlxd_engine_load", "requests routed to the engine and not finished"),
    "used_slots": ("mlxd_engine_kv_slots_used", "KV slots held by running requests, per engine"),
    "cached_slots": ("mlxd_engine_kv_slots_cached", "KV slots in the engine's prefix cache"),
    "capacity": ("mlxd_engine_kv_slots_capacity", "the engine's KV pool size in tokens"),
}


MODEL_GAUGES = {key: STATS_GAUGES[key] for key in
                ("running", "waiting", "used_slots", "cached_slots", "capacity")}


class _EngineMetrics:
    """Per-model and per-engine gauges, the router's counters and the models' states,
    as of the latest stats (an engine that left has no series)."""

    def __init__(self):
        self.latest: dict[str, dict] = {}   # model -> its merged stats
        self.states: list[dict] = []        # each model's state, loads, unloads

    def collect(self):
        yield from self._per_model()
        yield from self._per_engine()
        yield from self._router()
        yield from self._states()

    def _per_model(self):
        for key, (name, text) in MODEL_GAUGES.items():
            family = GaugeMetricFamily(name.replace("mlxd_", "mlxd_model_", 1),
                                       f"{text}, per model", labels=["model"])
            for model, stats in sorted(self.latest.items()):
                if isinstance(stats.get(key), (int, float)):
                    family.add_metric([model], stats[key])
            yield family

    def _engines(self):
        for model, stats in sorted(self.latest.items()):
            for engine, figures in sorted((stats.get("engines") or {}).items()):
                yield model, engine, figures

    def _per_engine(self):
        for key, (name, text) in ENGINE_GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=["model", "engine"])
            for model, engine, figures in self._engines():
                if isinstance(figures.get(key), (int, float)):
                    family.add_metric([model, engine], figures[key])
            yield family
        routed = CounterMetricFamily("mlxd_engine_routed", "requests routed to the engine",
                                     labels=["model", "engine"])
        for model, engine, figures in self._engines():
            routed.add_metric([model, engine], figures.get("routed", 0))
        yield routed

    def _router(self):
        decisions = CounterMetricFamily("mlxd_router_decisions", "routing decisions by "
                                        f"reason ({', '.join(REASONS)})",
                                        labels=["model", "reason"])
        up = GaugeMetricFamily("mlxd_engines_up", "engines serving", labels=["model"])
        losses = CounterMetricFamily("mlxd_engine_losses", "engines lost (died, vanished)",
                                     labels=["model"])
        for model, stats in sorted(self.latest.items()):
            router = stats.get("router") or {}
            for reason, n in sorted((router.get("decisions") or {}).items()):
                decisions.add_metric([model, reason], n)
            up.add_metric([model], router.get("engines_up", 0))
            losses.add_metric([model], router.get("losses", 0))
        yield from (decisions, up, losses)

    def _states(self):
        state = GaugeMetricFamily("mlxd_model_state", "1 for each model's state "
                                  f"({', '.join(STATES)})", labels=["model", "state"])
        loads = CounterMetricFamily("mlxd_model_loads", "times the model was loaded",
                                    labels=["model"])
        failures = CounterMetricFamily("mlxd_model_load_failures", "times the model's load "
                                       "failed", labels=["model"])
        unloads = CounterMetricFamily("mlxd_model_unloads", "times the model was unloaded, "
                                      "by reason (memory, idle, admin)",
                                      labels=["model", "reason"])
        for model in self.states:
            for name in STATES:
                state.add_metric([model["model"], name], float(model["state"] == name))
            loads.add_metric([model["model"]], model["loads"])
            failures.add_metric([model["model"]], model["failures"])
            for reason, n in sorted(model["unloads"].items()):
                unloads.add_metric([model["model"], reason], n)
        yield from (state, loads, failures, unloads)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxd_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finish = Counter("mlxd_request_finished", "generations by finish reason",
                              ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("mlxd_generation_tokens", "generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("mlxd_prefix_cache_hit_tokens",
                                     "prompt tokens whose KV came from the prefix cache",
                                     registry=r)
        self.disk_tokens = Counter("mlxd_prefix_cache_disk_hit_tokens",
                                   "of the prefix cache's hit tokens, those read from the "
                                   "disk tier (--kv-disk); the rest came from memory",
                                   registry=r)
        self.pinned_tokens = Counter("mlxd_prefix_cache_pinned_tokens",
                                     "prompt tokens computed and pinned by cache_control",
                                     registry=r)
        self.resumed = Counter("mlxd_requests_resumed", "generations that went on after "
                               "the death of a process running them (counted once each, "
                               "when they finish)", registry=r)
        self.resumes = Counter("mlxd_request_resumes", "resumes of those generations "
                               "(one per process death each lived through)", registry=r)
        self.ttft = Histogram("mlxd_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("mlxd_inter_token_latency_seconds",
                                     "time between tokens", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("mlxd_e2e_request_latency_seconds", "request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.gauges = {key: Gauge(name, text, registry=r)
                       for key, (name, text) in STATS_GAUGES.items()}
        self.step_ms = Gauge("mlxd_worker_step_ms", "worker compute time per step "
                             "(mean over recent steps)", registry=r)
        self.spec = _SpecCounters()
        r.register(self.spec)
        self.engines = _EngineMetrics()
        r.register(self.engines)

    def finished(self, chunk: StreamChunk, seconds: float) -> None:
        self.finish.labels(chunk.finish_reason).inc()
        self.e2e.observe(seconds)
        if chunk.usage:
            self.prompt_tokens.inc(chunk.usage.get("prompt_tokens", 0))
            self.generation_tokens.inc(chunk.usage.get("completion_tokens", 0))
            self.cached_tokens.inc(chunk.usage.get("cached_tokens", 0))
            self.disk_tokens.inc(chunk.usage.get("disk_tokens", 0))
            self.pinned_tokens.inc(chunk.usage.get("pinned_tokens", 0))
            resumes = chunk.usage.get("resumes", 0)
            if resumes:
                self.resumed.inc()
                self.resumes.inc(resumes)

    def render(self, by_model: dict[str, dict], states: list[dict] = ()) -> bytes:
        """The text exposition, the gauges set from each model's merged stats (the
        unlabelled ones: all models together) and `states` (each model's)."""
        total: dict = {}
        for stats in by_model.values():
            add_stats(total, stats)
        for key, gauge in self.gauges.items():
            if isinstance(total.get(key), (int, float)):
                gauge.set(total[key])
        self.engines.latest = by_model
        self.engines.states = list(states)
        if isinstance(total.get("speculative"), dict):
            self.spec.latest = total["speculative"]
        means = [((s.get("timing") or {}).get("compute_ms") or {}).get("mean")
                 for s in by_model.values()]
        means = [m for m in means if isinstance(m, (int, float))]
        if means:
            self.step_ms.set(max(means))
        return generate_latest(self.registry)

