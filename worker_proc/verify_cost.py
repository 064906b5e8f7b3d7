"""What a forward of several tokens costs next to one: the curve speculative decoding is
worth its drafts by.

A verify of a row's draft is one forward of `1 + len(draft)` positions; whether a
draft pays depends on how much more that costs than one position on this machine
(on a GPU, or a CPU reading weights from memory, little; on a CPU whose matrix
products are compute-bound, nearly in proportion). The worker measures it once at
startup, in a bounded time, and reports it (WorkerLimits.verify_costs); the scheduler
sizes drafts by it (scheduler_proc/speculation.py).
"""

import time

import mlx.core as mx

PROBE_SIZES = (1, 8, 2, 4, 16, 32)   # the first two always, the rest while time lasts
MOST_POSITIONS = 64     # the curve's length: costs of 1..64 positions
ROUNDS = 3              # each size timed once a round; its fastest time counts


def measure_verify_costs(model, budget_s: float = 3.0) -> list[float]:
    """Relative costs `c[n - 1]` of one forward of n positions, n = 1..MOST_POSITIONS,
    c[0] = 1. Each of PROBE_SIZES is warmed up once (the first two always, the others
    while `budget_s` lasts), then timed once a round for up to ROUNDS rounds (the
    second and third while time lasts); a size's fastest time counts, so a machine
    busy with other work skews the curve less than it slows it. Then the curve is made
    non-decreasing, linear between measured sizes and beyond the last two."""
    start = time.perf_counter()

    def forward(n: int) -> float:
        return _forward_seconds(model, n)

    sizes = []
    for i, n in enumerate(PROBE_SIZES):
        if i >= 2 and time.perf_counter() - start > budget_s / 2:
            break
        forward(n)   # warm-up: this shape's kernels, the buffer cache
        sizes.append(n)
    best = {n: forward(n) for n in sizes}
    for _ in range(ROUNDS - 1):
        if time.perf_counter() - start > budget_s:
            break
        for n in sizes:
            best[n] = min(best[n], forward(n))
    return cost_curve(best)


def measure_draft_cost(model, draft) -> float:
    """What one forward of one position of the draft model costs next to one of the
    model's (each warmed up, then the fastest of ROUNDS)."""
    times = []
    for m in (model, draft):
        _forward_seconds(m, 1)
        times.append(min(_forward_seconds(m, 1) for _ in range(ROUNDS)))
    return times[1] / times[0]


def _forward_seconds(model, n: int) -> float:
    """The time of one forward of n positions (no cache)."""
    tokens = mx.zeros((1, n), dtype=mx.int32)
    t = time.perf_counter()
    mx.eval(model(tokens))
    return time.perf_counter() - t


def cost_curve(measured: dict[int, float]) -> list[float]:
    """The curve from forward times at some sizes (1 among them): relative to one
    position, non-decreasing, interpolated and extrapolated linearly."""
    base = measured[1]
    sizes = sorted(measured)
    points, peak = [], 0.0
    for n in sizes:
        peak = max(peak, measured[n] / base)
        points.append((n, peak))
    curve = []
    for n in range(1, MOST_POSITIONS + 1):
        curve.append(round(_linear(points, n), 4))
    return curve


def _linear(points: list[tuple[int, float]], n: int) -> float:
    if len(points) == 1:
        return float(n)   # nothing measured beyond one position: assume proportional
    for (n0, c0), (n1, c1) in zip(points, points[1:]):
        if n <= n1:
            return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
    (n0, c0), (n1, c1) = points[-2], points[-1]
    return c1 + (c1 - c0) * (n - n1) / (n1 - n0)
