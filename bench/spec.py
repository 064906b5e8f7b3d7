"""Speculative decoding: decode tok/s with `--speculative off` and `--speculative ngram`
(or, given `--draft-model`, `--speculative draft`) on chat traces whose answers repeat their prompts (edit a file, quote a passage) and
one whose answer does not (an open question), each at several concurrency levels, and
the verify cost curve that bounds what speculation can gain on this machine.

    python -m bench.spec                              # ~40M random-weight model, 8k context
    python -m bench.spec --model smollm2              # the server's default model
    python -m bench.spec --concurrency 1,8,32 --gen-len 128 --repeats 3 --json spec.json
    python -m bench.spec --cost-curve-only            # the verify cost curve alone
    python -m bench.spec --model smollm2 --draft-model PATH   # off vs a draft model

One server per mode runs for the whole bench. Every (trace, concurrency) runs
`--repeats` times in each mode, the two modes alternating (off first, then ngram
first, ...), so that each repeat's ratio compares runs seconds apart. Requests are
greedy with a fixed max_tokens; every copy of a trace has its own rid. Decode tok/s
counts the tokens after each request's first one, over the time from the first
first token to the last token of all copies. The speculative counters are the
differences of the server's stats ("speculative") around each measured run.

The verify cost curve: in a child with the worker's BLAS and the worker's weights
(float32 on the CPU), one forward of M tokens (M = 1..16) at a fixed context,
the cache trimmed back after each. A verify of M - 1 drafts yields 1 + accepted
tokens for cost(M), so it beats plain decoding when accepted tokens per verify
exceed cost(M)/cost(1) - 1: the break-even shown for each M.
"""

import argparse
import asyncio
import hashlib
import json
import statistics
import subprocess
import sys

from bench.common import ROOT, MlxdServer, bench_model, blas_env, machine_summary, now, random_prompts, tokenizer_vocab
from bench.serving.__main__ import default_model

COUNTERS = ("verifies", "draft_tokens", "accepted_tokens")
MAX_M = 16


# ---- traces --------------------------------------------------------------------------


def _code_to_edit() -> str:
    return (ROOT / "bench" / "common.py").read_text()


def _passage() -> str:
    """The "Follow one request" section of docs/ARCHITECTURE.md (~600 words)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    start = text.index("## Follow one request")
    return text[start:text.index("\n## ", start + 1)].strip()


def trace_messages(name: str) -> list[dict]:
    """The chat messages of trace `name` (edit, quote or chat)."""
    if name == "edit":
        ask = ("Here is a Python file:\n\n```python\n" + _code_to_edit() + "```\n\n"
               "Rename the function `random_prompts` to `make_random_prompts` (its uses "
               "too) and return the whole file, unchanged otherwise, in one code block.")
    elif name == "quote":
        ask = (_passage() + "\n\nQuote step 4 of the text above, the paragraph that starts "
               "with \"**Computed**\", word for word.")
    else:
        ask = ("What makes a city pleasant to live in? Discuss transport, housing, parks "
               "and noise, with an example of each.")
    return [{"role": "user", "content": ask}]


TRACES = {"edit": "return a file with one rename", "quote": "quote a paragraph verbatim",
          "chat": "an open question"}


# ---- one measured run ----------------------------------------------------------------


async def _one(c, messages: list[dict], gen_len: int, rid: str) -> dict:
    first = end = None
    tokens, prompt_tokens = [], None
    async for chunk in c.stream(messages=messages, rid=rid, max_tokens=gen_len, temperature=0):
        if chunk.token_ids and first is None:
            first = now()
        tokens += chunk.token_ids
        end = now()
        if chunk.usage:
            prompt_tokens = chunk.usage.get("prompt_tokens")
    return {"tokens": tokens, "first": first, "end": end, "prompt_tokens": prompt_tokens}


def counter_delta(before: dict | None, after: dict | None) -> dict:
    """The speculative counters' growth between two stats snapshots (None where the
    server reports none)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return {k: None for k in COUNTERS}
    return {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}


async def _drive(server: MlxdServer, messages: list[dict], concurrency: int, gen_len: int,
                 tag: str) -> dict:
    """`concurrency` copies of one trace at once: the aggregate decode tok/s, the
    counters' growth, and each copy's tokens."""
    from mlxd.client import AsyncClient

    async with AsyncClient(server.address, timeout=600) as c:
        before = (await c.stats()).get("speculative")
        runs = await asyncio.gather(*(_one(c, messages, gen_len, f"{tag}-{i}")
                                      for i in range(concurrency)))
        after = (await c.stats()).get("speculative")
    started = [r for r in runs if r["first"] is not None]
    decoded = sum(len(r["tokens"]) - 1 for r in started)   # after each first token
    span = max(r["end"] for r in started) - min(r["first"] for r in started) if started else 0.0
    return {"tok_s": decoded / span if span > 0 else 0.0, "decoded_tokens": decoded,
            "seconds": span, "completion_tokens": [len(r["tokens"]) for r in runs],
            "prompt_tokens": runs[0]["prompt_tokens"], "tokens": [r["tokens"] for r in runs],
            "method": (after or {}).get("method"), **counter_delta(before, after)}


async def _warm_up(server: MlxdServer, traces: list[str]) -> None:
    """Every trace once, short: compiles the kernels and leaves each prompt in the
    radix cache, so that no measured run's first copy prefills alone."""
    from mlxd.client import AsyncClient

    async with AsyncClient(server.address, timeout=600) as c:
        for name in traces:
            await c.chat(trace_messages(name), max_tokens=4, temperature=0)


# ---- summaries -----------------------------------------------------------------------


def spec_figures(verifies, draft_tokens, accepted_tokens) -> dict:
    """Tokens per verify step (each verify also yields the target's own token) and the
    share of drafted tokens accepted; None where there is nothing to divide by."""
    per_step = 1 + accepted_tokens / verifies if verifies else None
    rate = accepted_tokens / draft_tokens if draft_tokens else None
    return {"tokens_per_verify": per_step, "acceptance_rate": rate}


def summarize(repeats: list[dict], mode: str = "ngram") -> dict:
    """One (trace, concurrency): median rates per mode, the median of the per-repeat
    ratios `mode`/off, the `mode` runs' counters summed, and whether both modes gave
    the same tokens (greedy: they should)."""
    off = [r["off"]["tok_s"] for r in repeats]
    on = [r[mode]["tok_s"] for r in repeats]
    ratios = [b / a for a, b in zip(off, on) if a > 0]
    counts = {k: None if any(r[mode][k] is None for r in repeats)
              else sum(r[mode][k] for r in repeats) for k in COUNTERS}
    figures = (spec_figures(*(counts[k] for k in COUNTERS))
               if counts["verifies"] is not None else spec_figures(0, 0, 0))
    same = all(tokens == r["off"]["tokens"][0] for r in repeats for tokens in r[mode]["tokens"])
    return {"tok_s_off": statistics.median(off), f"tok_s_{mode}": statistics.median(on),
            "ratio": statistics.median(ratios) if ratios else None, "ratios": ratios,
            **counts, **figures, "same_tokens": same}


# ---- the verify cost curve -----------------------------------------------------------


def verify_cost_curve(model_path: str, context: int, repeats: int) -> list[dict]:
    """ms per forward of M = 1..MAX_M tokens after `context` cached tokens (median of
    `repeats`, the M's interleaved within each repeat), the cache trimmed back after
    each forward. Runs in a child with the worker's BLAS (`cost_curve_in_child`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlxd.worker_proc.loading import load_model, resolve_dequantize

    model, _ = load_model(model_path, resolve_dequantize("auto"))
    prompt = random_prompts(1, context + MAX_M, tokenizer_vocab(model_path), seed=5)[0]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:context]]), cache=cache))
    drafts = {m: mx.array([prompt[context:context + m]]) for m in range(1, MAX_M + 1)}
    times = {m: [] for m in drafts}
    for r in range(repeats + 2):   # the first two rounds warm up
        for m, tokens in drafts.items():
            start = now()
            mx.eval(model(tokens, cache=cache))
            if r >= 2:
                times[m].append((now() - start) * 1e3)
            trim_prompt_cache(cache, m)
    base = statistics.median(times[1])
    return [cost_entry(m, statistics.median(t), base, t) for m, t in times.items()]


def cost_entry(m: int, ms: float, base: float, runs: list[float]) -> dict:
    """One point of the curve; `break_even_accepted` is the accepted tokens per verify
    (M - 1 drafts) at which speculation matches plain decoding, and
    `break_even_acceptance` that as a share of the drafts (over 1: never pays)."""
    ratio = ms / base
    return {"m": m, "ms": ms, "cost_ratio": ratio, "runs_ms": runs,
            "break_even_accepted": ratio - 1 if m > 1 else None,
            "break_even_acceptance": (ratio - 1) / (m - 1) if m > 1 else None}


def cost_curve_in_child(args) -> list[dict]:
    cmd = [sys.executable, "-m", __spec__.name, "--model", args.model, "--cost-context",
           str(args.cost_context), "--cost-repeats", str(args.cost_repeats), "--cost-curve-child"]
    out = subprocess.run(cmd, env=blas_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the cost-curve child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the bench -----------------------------------------------------------------------


def run_traces(args) -> dict:
    """{trace: {concurrency: {"repeats": [{mode: run}], "summary": ...}}}."""
    levels = args.concurrency
    flags = ["--max-running-requests", str(max(levels)), *args.server_args.split()]
    if args.spec_max_draft:
        flags += ["--spec-max-draft", str(args.spec_max_draft)]
    modes = ("off", args.mode)
    drafting = ["--draft-model", args.draft_model] if args.draft_model else []
    servers = {}
    try:
        for mode in modes:
            servers[mode] = MlxdServer(args.model, "--speculative", mode, *flags,
                                       *(drafting if mode == "draft" else []))
            asyncio.run(_warm_up(servers[mode], args.traces))
        results = {}
        for name in args.traces:
            messages = trace_messages(name)
            results[name] = {}
            for n in levels:
                repeats = []
                for r in range(args.repeats):
                    order = modes if r % 2 == 0 else modes[::-1]
                    repeats.append({mode: asyncio.run(_drive(
                        servers[mode], messages, n, args.gen_len, f"{name}-{mode}-{n}-{r}"))
                        for mode in order})
                summary = summarize(repeats, args.mode)
                for run in (run for repeat in repeats for run in repeat.values()):
                    del run["tokens"]   # compared in the summary; too long to keep
                results[name][n] = {"repeats": repeats, "summary": summary}
    finally:
        for server in servers.values():
            server.stop()
    return results


def _fmt(value, spec: str) -> str:
    """`value` formatted, or "-" as wide, where there is none."""
    return "-".rjust(int(spec.split(".")[0].rstrip("df") or 0)) if value is None else format(value, spec)


def print_traces(results: dict, args) -> None:
    mode = args.mode
    print(f"greedy, {args.gen_len} output tokens per request; decode tok/s, all copies "
          f"together; counters from the {mode} server")
    print(f"{'trace':6s} {'conc':>4s} {'off':>8s} {mode:>8s} {'ratio':>6s} {'verifies':>8s} "
          f"{'drafted':>8s} {'accepted':>8s} {'tok/step':>8s} {'accept':>6s} same")
    for name, levels in results.items():
        for n, entry in levels.items():
            s = entry["summary"]
            print(f"{name:6s} {n:4d} {s['tok_s_off']:8.1f} {s[f'tok_s_{mode}']:8.1f} "
                  f"{_fmt(s['ratio'], '6.3f')} {_fmt(s['verifies'], '8d')} "
                  f"{_fmt(s['draft_tokens'], '8d')} {_fmt(s['accepted_tokens'], '8d')} "
                  f"{_fmt(s['tokens_per_verify'], '8.2f')} {_fmt(s['acceptance_rate'], '6.2f')} "
                  f"{'yes' if s['same_tokens'] else 'no'}")


def print_curve(curve: list[dict], context: int) -> None:
    print(f"verify cost at {context} cached tokens (in-process, the worker's weights "
          f"and BLAS): one forward of M tokens")
    print(f"{'M':>3s} {'ms':>8s} {'cost/cost(1)':>12s} {'break-even accepted':>20s} "
          f"{'break-even acceptance':>22s}")
    for e in curve:
        print(f"{e['m']:3d} {e['ms']:8.2f} {e['cost_ratio']:12.3f} "
              f"{_fmt(e['break_even_accepted'], '20.2f')} "
              f"{_fmt(e['break_even_acceptance'], '22.2f')}")


def inputs(args) -> dict:
    traces = {}
    for name in args.traces:
        text = trace_messages(name)[0]["content"]
        traces[name] = {"about": TRACES[name], "chars": len(text),
                        "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
    return {"model": args.model, "concurrency": args.concurrency, "gen_len": args.gen_len,
            "repeats": args.repeats, "spec_max_draft": args.spec_max_draft,
            "draft_model": args.draft_model,
            "server_args": args.server_args, "cost_context": args.cost_context,
            "cost_repeats": args.cost_repeats, "traces": traces}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a model folder or smollm2; default: the bench model, 8k context "
                         "(the edit trace's prompt passes 2k of its tokens)")
    ap.add_argument("--concurrency", default="1,8,32", help="copies of each trace at once")
    ap.add_argument("--traces", default=",".join(TRACES), help="of " + ", ".join(TRACES))
    ap.add_argument("--gen-len", type=int, default=128, help="max_tokens of every request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-max-draft", type=int, default=0,
                    help="the ngram server's --spec-max-draft (0: its default)")
    ap.add_argument("--server-args", default="", help="extra launch.py flags for both servers")
    ap.add_argument("--draft-model", default="",
                    help="compare off with --speculative draft on this draft model "
                         "(instead of ngram)")
    ap.add_argument("--cost-context", type=int, default=512, help="cached tokens of the cost curve")
    ap.add_argument("--cost-repeats", type=int, default=7)
    ap.add_argument("--cost-curve-only", action="store_true", help="only the verify cost curve")
    ap.add_argument("--cost-curve-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    args.model = bench_model(args.model) if args.model else default_model()
    args.mode = "draft" if args.draft_model else "ngram"
    if args.cost_curve_child:
        print(json.dumps(verify_cost_curve(args.model, args.cost_context, args.cost_repeats)))
        return
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.traces = [t for t in args.traces.split(",") if t]
    unknown = set(args.traces) - set(TRACES)
    if unknown:
        ap.error(f"unknown traces: {', '.join(sorted(unknown))}")
    report = {"machine": machine_summary(), "inputs": inputs(args)}
    print(f"{args.model} on {report['machine']}")
    if not args.cost_curve_only:
        results = run_traces(args)
        report["traces"] = {name: {str(n): e for n, e in levels.items()}
                            for name, levels in results.items()}
        print_traces(results, args)
    report["cost_curve"] = cost_curve_in_child(args)
    print_curve(report["cost_curve"], args.cost_context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
