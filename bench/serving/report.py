"""The report of bench/serving/: one table on stdout, and PNG plots (TTFT and
ITL CDFs per trace, output throughput vs offered load over the Poisson rates).

Everything here reads the results dict that serving.py also saves as
results.json, so the plots can be redrawn from a saved run.
"""

import sys
from pathlib import Path

from bench.serving.metrics import METRICS, itl_samples, winner

LABELS = {"mlxd": "mlxd", "mlx_lm": "mlx_lm.server", "mlxd_http": "mlxd (HTTP)",
          "mlxd_padded": "mlxd (padded)", "mlxd_kv8": "mlxd (--kv-bits 8)",
          "tie": "tie"}


def format_metric(key: str, value) -> str:
    """A metric of METRICS for a table: throughputs as numbers, latencies in ms or s."""
    if value is None:
        return "-"
    if key == "errors":
        return str(value)
    if key.endswith("throughput"):
        return f"{value:.2f}" if value < 100 else f"{value:.1f}"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def format_table(results: dict) -> str:
    """Rows: each trace's systems and the ratio mlxd / mlx_lm; columns: metrics."""
    width = 10
    labels = "".join(f"{label:>{width}}" for _, label, _, _ in METRICS)
    head = f"{'trace':<14}{'system':<15}" + labels
    lines = [head, "-" * len(head)]
    for name, trace in results["traces"].items():
        for system, run in trace["systems"].items():
            label = f"{name:<14}{LABELS.get(system, system):<15}"
            if "metrics" not in run:
                first_line = (run.get("error") or "?").splitlines()[0]
                lines.append(label + f"  failed: {first_line}"[:200])
                continue
            m = run["metrics"]
            lines.append(label + "".join(f"{format_metric(k, m.get(k)):>{width}}"
                                         for k, *_ in METRICS))
        if trace.get("ratio"):
            cells = []
            for key, *_ in METRICS:
                r = trace["ratio"].get(key)
                mark = {"mlxd": "+", "mlx_lm": "-", None: " "}[winner(key, r)]
                cells.append("-" if r is None else f"{r:.2f}{mark}")
            lines.append(f"{name:<14}{'mlxd/mlx_lm':<15}" + "".join(f"{c:>{width}}" for c in cells))
        for key_name, row in (("http_over_sdk", "http/sdk"), ("paged_over_padded", "paged/padded")):
            if trace.get(key_name):
                cells = ["-" if (r := trace[key_name].get(key)) is None else f"{r:.2f}"
                         for key, *_ in METRICS]
                lines.append(f"{name:<14}{row:<15}" + "".join(f"{c:>{width}}" for c in cells))
        lines.append("")
    lines.append("ratio = mlxd / mlx_lm.server; '+' where mlxd is better (higher req/s and "
                 "tok/s, lower latency), '-' where mlx_lm.server is; http/sdk = mlxd over "
                 "its HTTP API / mlxd through its SDK; paged/padded = mlxd / mlxd with "
                 "--decode-layout padded.")
    lines.append("TTFT: send to first token; ITL: gap between streamed chunks per token; "
                 "E2E: send to last reply.")
    return "\n".join(lines)


HEADLINE = ("output_throughput", "ttft_p50", "itl_p50", "e2e_p99")


def format_verdict(results: dict) -> str:
    """One line per trace: the headline ratios, who is ahead, and a tally."""
    labels = {key: label for key, label, _, _ in METRICS}
    lines = ["who wins (ratio mlxd / mlx_lm.server, winner):"]
    for name, trace in results["traces"].items():
        ratio = trace.get("ratio")
        if not ratio:
            continue
        parts = [f"{labels[k]} {ratio[k]:.2f}x {LABELS[winner(k, ratio[k]) or 'tie']}"
                 for k in HEADLINE if ratio.get(k) is not None]
        wins = [winner(k, r) for k, r in ratio.items() if r is not None]
        parts.append(f"mlxd ahead on {wins.count('mlxd')} of {len(wins)} metrics")
        lines.append(f"  {name:<12}" + " | ".join(parts))
    return "\n".join(lines) if len(lines) > 1 else ""


def format_notes(results: dict) -> str:
    """Token-count checks and the first error of each run."""
    lines = []
    for name, trace in results["traces"].items():
        for system, run in trace["systems"].items():
            m, where = run.get("metrics"), f"{name} / {LABELS.get(system, system)}"
            if m is None:
                tail = (run.get("error") or "?").splitlines()[-3:]
                lines.append(f"{where} failed: " + " / ".join(t.strip() for t in tail))
                continue
            checks = run.get("prompt_check", {})
            if checks.get("identical") != checks.get("checked"):
                lines.append(f"{where}: {checks['checked'] - checks['identical']} of "
                             f"{checks['checked']} prompts encode differently in the two servers")
            if checks.get("drawn_mismatches"):
                lines.append(f"{where}: {checks['drawn_mismatches']} prompts encode to another "
                             "length than the trace drew (a trace made for another model?)")
            for key in ("output_token_mismatches", "prompt_token_mismatches"):
                if m.get(key):
                    lines.append(f"{where}: {m[key]} {key.replace('_', ' ')}")
            if m.get("itl_estimated_requests"):
                lines.append(f"{where}: {m['itl_estimated_requests']} streams had fewer chunks "
                             "than tokens (ITL per token estimated)")
            if m.get("connection_retries"):
                lines.append(f"{where}: {m['connection_retries']} connections reset before the "
                             "server read them (listen backlog overflow), retried; the delay "
                             "counts in TTFT")
            if run.get("first_error"):
                lines.append(f"{where}: {m['errors']} errors, first: {run['first_error']}")
    lines += _prompt_size_notes(results)
    return "\n".join(lines) if lines else "token counts: every request as drawn, no errors"


def _prompt_size_notes(results: dict) -> list[str]:
    """Multiturn prompts carry each system's own answers, whose text (and so the
    next prompt's length) can differ: say so when the totals differ by > 5%."""
    lines = []
    for name, trace in results["traces"].items():
        totals = {s: run["metrics"]["prompt_tokens"] for s, run in trace["systems"].items()
                  if "metrics" in run}
        if len(totals) == 2 and max(totals.values()) > 1.05 * min(totals.values()):
            lines.append(f"{name}: prompts totalled " + " vs ".join(
                f"{n} tokens on {LABELS.get(s, s)}" for s, n in totals.items()) +
                " (the conversations carry each system's answer text)")
    return lines


# ---- plots -------------------------------------------------------------------------


def _latencies(requests: list[dict]) -> tuple[list[float], list[float]]:
    ok = [r for r in requests if r.get("error") is None and r.get("chunk_times")]
    ttft = [r["chunk_times"][0] - r["sent"] for r in ok]
    itl = [x for r in ok
           for x in itl_samples(r["chunk_times"], r["chunk_tokens"], r["output_tokens"])]
    return ttft, itl


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step([xs[0]] + xs, [0.0] + ys, where="post", label=label)


def plot_cdfs(plt, results: dict, out: Path) -> list[Path]:
    paths = []
    for name, trace in results["traces"].items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for system, run in trace["systems"].items():
            ttft, itl = _latencies(run.get("requests", []))
            _cdf(axes[0], ttft, LABELS.get(system, system))
            _cdf(axes[1], itl, LABELS.get(system, system))
        for ax, title in zip(axes, ("time to first token", "inter-token latency")):
            ax.set_xscale("log")
            ax.set_xlabel("seconds (log)")
            ax.set_ylabel("fraction of " + ("requests" if ax is axes[0] else "tokens"))
            ax.set_title(f"{name}: {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out / f"cdf_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def load_series(results: dict) -> dict[str, list[tuple[float, dict]]]:
    """Per system: (offered req/s, metrics) for every Poisson trace, by rate."""
    series: dict[str, list[tuple[float, dict]]] = {}
    for trace in results["traces"].values():
        if trace["header"]["kind"] != "poisson":
            continue
        rate = trace["header"]["params"]["rate"]
        for system, run in trace["systems"].items():
            if "metrics" in run:
                series.setdefault(system, []).append((rate, run["metrics"]))
    return {s: sorted(points, key=lambda p: p[0]) for s, points in series.items()}


def offered_output(results: dict) -> dict[float, float]:
    """Per Poisson rate: the output tok/s its arrivals asked for (the realized
    arrival rate, which for few requests strays from the nominal one, times the
    mean output length)."""
    offered = {}
    for trace in results["traces"].values():
        if trace["header"]["kind"] != "poisson":
            continue
        for run in trace["systems"].values():
            sent = [r["sent"] for r in run.get("requests", [])]
            if len(sent) > 1 and max(sent) > min(sent):
                asked = [r["expected_output_tokens"] for r in run["requests"]]
                arrivals_per_s = (len(sent) - 1) / (max(sent) - min(sent))
                rate = trace["header"]["params"]["rate"]
                offered[rate] = arrivals_per_s * sum(asked) / len(asked)
    return offered


def plot_load(plt, results: dict, out: Path) -> list[Path]:
    series = load_series(results)
    if not any(len(points) > 1 for points in series.values()):
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    offered = offered_output(results)
    axes[0].plot(sorted(offered), [offered[r] for r in sorted(offered)], "--", color="gray",
                 label="offered (arrivals x mean output)")
    for system, points in series.items():
        rates = [p[0] for p in points]
        axes[0].plot(rates, [p[1]["output_throughput"] for p in points], "o-",
                     label=LABELS.get(system, system))
        axes[1].plot(rates, [p[1]["ttft_p50"] for p in points], "o-",
                     label=LABELS.get(system, system))
    axes[0].set_ylabel("output tok/s")
    axes[1].set_ylabel("TTFT p50 (s)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("offered load (req/s, Poisson)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("throughput and latency vs offered load")
    fig.tight_layout()
    path = out / "throughput_vs_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def write_plots(results: dict, out: Path) -> list[Path]:
    """The PNGs, or none (with a note) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plots were drawn (results.json "
              "has everything); pip install -e '.[bench]' to get them", file=sys.stderr)
        return []
    return plot_cdfs(plt, results, out) + plot_load(plt, results, out)
