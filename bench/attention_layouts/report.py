"""The results as one markdown table (and the run's conditions above it)."""

from .cases import Case
from .run import Result


def summary(info: dict) -> str:
    before = ", ".join(f"{x:.2f}" for x in info["load_before"])
    after = ", ".join(f"{x:.2f}" for x in info["load_after"])
    return (f"{info['machine']}; MLX {info['mlx']}; BLAS {info['blas']}\n"
            f"{info['shape']}; median of {info['repeats']} repeats after {info['warmup']} "
            f"warm-up, layouts alternating; paged: {info['page']}-position pages\n"
            f"load average before {before}; after {after}\n")


def markdown(results: list[Result], cases: list[Case]) -> str:
    own_a = {r.layout: r.step_ms for r in results if r.case == "A"}
    base = own_a.get("padded")
    title = {c.name: c.title for c in cases}
    lines = ["| case | layout | step ms | x A padded | x A same layout | KV held MB | join ms "
             "| join / step |", "|---|---|---|---|---|---|---|---|"]
    shown = set()
    for r in results:
        case = r.case if r.case in shown else f"{r.case}: {title[r.case]}"
        shown.add(r.case)
        ratio = f"{r.step_ms / base:.2f}" if base else "—"
        same = f"{r.step_ms / own_a[r.layout]:.2f}" if r.layout in own_a else "—"
        held = f"{r.held_bytes / 2**20:.1f}" if r.held_bytes is not None else "—"
        join = f"{r.join_ms:.2f}" if r.join_ms is not None else "—"
        join_ratio = f"{r.join_ms / r.step_ms:.2f}" if r.join_ms is not None else "—"
        lines.append(f"| {case} | {r.layout} | {r.step_ms:.2f} | {ratio} | {same} "
                     f"| {held} | {join} | {join_ratio} |")
    return "\n".join(lines)
