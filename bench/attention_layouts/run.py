"""Build every layout for a case, check its output, and time the steps (and the
join) with the layouts alternating within each repeat."""

import os
import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from .cases import Batch, Case, Shape, make_batch, reference
from .layouts import GatherThenAttend, Layout, Padded, PaddedByHand, PerRow, WidthClasses
from .merged import Cascade, Paged, prefix_product


@dataclass
class Result:
    case: str
    layout: str
    step_ms: float
    held_bytes: int | None   # None: a probe, not a layout
    max_diff: float | None
    join_ms: float | None = None
    samples: list[float] = field(default_factory=list, repr=False)


def tolerance(dtype: mx.Dtype) -> float:
    return 1e-4 if dtype == mx.float32 else 2e-2


def build_layouts(batch: Batch, page: int) -> list[Layout]:
    padded = Padded(batch)
    layouts = [padded, PaddedByHand(batch, like=padded), WidthClasses(batch), PerRow(batch),
               GatherThenAttend(batch), Paged(batch, page)]
    if batch.case.prefix_len:
        layouts.append(Cascade(batch))
    for layout in layouts:
        mx.eval(layout.arrays())
    return layouts


def check(layouts: list[Layout], batch: Batch) -> dict[str, float]:
    """Every layout's max abs difference from the reference; AssertionError beyond
    the dtype's tolerance."""
    want = reference(batch)
    diffs = {}
    for layout in layouts:
        got = layout.step().astype(mx.float32)
        diff = mx.max(mx.abs(got - want)).item()
        assert got.shape == want.shape and diff < tolerance(batch.shape.dtype), \
            f"case {batch.case.name}, {layout.name}: max abs diff {diff:.3g}"
        diffs[layout.name] = diff
    return diffs


def timed(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1e3


def measure(jobs: dict[str, object], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Milliseconds per call of each job (a function returning arrays to evaluate),
    the jobs alternating in a rotating order within every repeat so that the
    machine's other load hits all alike."""
    names = list(jobs)
    samples = {name: [] for name in names}
    for i in range(warmup + repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            ms = timed(jobs[name])
            if i >= warmup:
                samples[name].append(ms)
    return samples


def run_case(case: Case, shape: Shape, repeats: int, warmup: int, page: int) -> list[Result]:
    batch = make_batch(case, shape)
    layouts = build_layouts(batch, page)
    diffs = check(layouts, batch)
    jobs = {layout.name: layout.step for layout in layouts}
    joins = {}
    if batch.join_row is not None:
        for layout in layouts:
            if layout.join(*batch.join_row) is not None:   # supported: measured
                joins[layout.name] = (lambda lay=layout: lay.join(*batch.join_row))
        jobs.update({f"join: {name}": fn for name, fn in joins.items()})
    if case.prefix_len:
        jobs["prefix product, hand-written"] = prefix_product(batch, by_hand=True)
        jobs["prefix product, mx.fast sdpa"] = prefix_product(batch, by_hand=False)
    samples = measure(jobs, repeats, warmup)
    med = {name: statistics.median(s) for name, s in samples.items()}
    results = [Result(case.name, lay.name, med[lay.name], lay.held(), diffs[lay.name],
                      med.get(f"join: {lay.name}"), samples[lay.name]) for lay in layouts]
    results += [Result(case.name, name, med[name], None, None, samples=samples[name])
                for name in jobs if name.startswith("prefix product")]
    del layouts, batch, jobs
    mx.clear_cache()
    return results


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()
