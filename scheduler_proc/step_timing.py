"""Per-step timing over a window of recent steps, for `Stats`.

Each step contributes the worker's own figures (StepResult.timing: compute,
wait for the Step, idle with nothing in flight, finishing the chained decode)
and the scheduler's: from receiving a result to sending the next Step.
"""

from collections import deque

WORKER_METRICS = ("compute_ms", "wait_ms", "idle_ms", "ahead_wait_ms")
METRICS = WORKER_METRICS + ("scheduler_ms",)
WINDOW = 256


class StepTimings:
    def __init__(self, window: int = WINDOW):
        self.steps = 0
        self.chained = 0
        self._recent: deque[tuple[float, ...]] = deque(maxlen=window)

    def record(self, worker_timing: dict, scheduler_ms: float) -> None:
        self.steps += 1
        self.chained += bool(worker_timing.get("chained"))
        values = [_ms(worker_timing.get(key)) for key in WORKER_METRICS]
        self._recent.append((*values, scheduler_ms))

    def summary(self) -> dict:
        """Totals, plus mean / p50 / p90 of each metric over the recent window, and
        the worker's idle share of its step cycle (wait + compute) in that window."""
        out: dict = {"steps": self.steps, "chained_steps": self.chained,
                     "window": len(self._recent)}
        if not self._recent:
            return out
        columns = dict(zip(METRICS, zip(*self._recent)))
        for name, values in columns.items():
            ordered = sorted(values)
            out[name] = {"mean": sum(values) / len(values), "p50": _quantile(ordered, 0.5),
                         "p90": _quantile(ordered, 0.9)}
        cycle = sum(columns["wait_ms"]) + sum(columns["compute_ms"])
        out["idle_fraction"] = sum(columns["idle_ms"]) / cycle if cycle else 0.0
        return out


def _ms(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
