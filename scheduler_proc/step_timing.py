"""Per-step timing over a window of recent steps, for `Stats`.

Each step contributes the worker's own figures (StepResult.timing: compute,
wait for the Step, idle with nothing in flight, finishing the chained decode)
and the scheduler's: from receiving a result to sending the next Step. A figure
a step does not have (the worker's wait after a pause with nothing running) is
left out of that figure's statistics.
"""

from collections import deque

from mlxd.protocol import StepTiming

METRICS = ("compute_ms", "wait_ms", "idle_ms", "chained_wait_ms", "scheduler_ms")
WINDOW = 256


class StepTimings:
    def __init__(self, window: int = WINDOW):
        self.steps = 0
        self.chained = 0
        self._recent: deque[tuple[float, ...]] = deque(maxlen=window)

    def record(self, worker: StepTiming, scheduler_ms: float) -> None:
        self.steps += 1
        self.chained += worker.chained
        self._recent.append((worker.compute_ms, worker.wait_ms, worker.idle_ms,
                             worker.chained_wait_ms, scheduler_ms))

    def summary(self) -> dict:
        """Totals, plus mean / p50 / p90 of each metric over the recent window, and
        the worker's idle share of its step cycle (wait + compute) in that window."""
        out: dict = {"steps": self.steps, "chained_steps": self.chained,
                     "window": len(self._recent)}
        if not self._recent:
            return out
        columns = dict(zip(METRICS, zip(*self._recent)))
        for name, column in columns.items():
            values = sorted(v for v in column if v is not None)
            if values:
                out[name] = {"mean": sum(values) / len(values), "n": len(values),
                             "p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9)}
        # over the steps that followed a round trip (those with a wait)
        steps = [(w, c, i) for w, c, i in zip(columns["wait_ms"], columns["compute_ms"],
                                              columns["idle_ms"]) if w is not None]
        cycle = sum(w + c for w, c, _ in steps)
        out["idle_fraction"] = sum(i or 0.0 for _, _, i in steps) / cycle if cycle else 0.0
        return out


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
