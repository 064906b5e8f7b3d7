"""Serving benchmark: mlxd vs mlx_lm.server, same model, same traffic.

    python -m bench.serving                               # all systems, all traces (~25-40 min)
    python -m bench.serving --systems mlxd --traces burst --num-requests 8
    python -m bench.serving --trace DIR/trace-burst.jsonl # replay saved traces
    python -m bench.serving --model smollm2 --out bench/results/serving-smollm2

The two servers run one after the other on the same model (default: the ~40M
random-weight bench model of bench/common.py, in a variant with an 8192-token
context for the long prompts), on loopback, each with the same BLAS preloaded
(bench/common.py blas_env(); mlxd's launcher does it for its worker). mlxd is
started with launch.py (`--mlxd-args` appended) and driven through the async
SDK (system `mlxd`) and, in a second run, through its HTTP API like mlx_lm.server
(`mlxd_http`, with `ignore_eos`; its table row `http/sdk` is HTTP over SDK);
mlx_lm.server (`python -m mlx_lm.server`, `--mlx-lm-args` appended) through its
OpenAI-style HTTP endpoints with `"stream": true`. Every process started
here is stopped on exit, errors and Ctrl-C included.

Traffic (bench/serving/traces.py), drawn from `--seed` and saved as JSONL in
`--out`, replayable with `--trace`:
  burst      --num-requests at t=0
  poisson    --num-requests arriving at --rate req/s, and again at each of
             --rates (the load sweep; same lengths, stretched arrivals, new text)
  multiturn  --sessions chat sessions of --turns turns; each turn resends the
             conversation so far (with the system's own answers) plus a new
             user message, through chat messages when the model has a template
  longmix    --num-requests short requests at --rate req/s, --long-count of them
             with ~--long-len-token prompts (head-of-line blocking)
Prompt and output lengths are lognormal (long-tailed), clipped.

Same tokens for both: prompts are text made of words that are one token each,
so a drawn length is exact, and the same text goes to both servers. Before a
run, every prompt is encoded with both servers' own tokenizer code (mlxd's
TextCodec, the TokenizerWrapper mlx_lm.server loads) and the ids compared; the
servers' reported prompt_tokens are compared with the local count afterwards.

Output lengths are exact: mlxd gets `ignore_eos=True`; mlx_lm.server has no such
option, so its requests carry `logit_bias` -1e9 on every EOS id of the model.
A request that does not return exactly the drawn number of tokens (usage
completion_tokens, finish "length") counts as an error, like one that fails or
exceeds `--timeout`.

Reported per system and trace: req/s, output tok/s, TTFT p50/p90/p99,
inter-token latency p50/p90/p99 (gaps between chunks that carry tokens, per
token), end-to-end latency p50/p99, errors, and mlxd / mlx_lm for each. mlx_lm's
SSE chunks carry text only and a token that decodes to no text yet is merged
into the next chunk, so there each chunk counts one token and the leftover
tokens (usage minus chunks) are given to the gaps that are longest per token
(exact when every token got its own chunk; the notes say how many streams were
estimated). `--out DIR` gets results.json (metrics, ratios, every request's
timings), the traces, and PNG plots: TTFT and ITL CDFs per trace and output
throughput vs offered load (needs matplotlib: pip install -e '.[bench]').

mlx_lm.server listens with a backlog of 5 (socketserver's default): in a burst,
the kernel drops or resets the connections beyond it. A connection that fails
before any response byte is retried (the server never read the request); the
lost time counts in TTFT and the number of retries is reported.

HTTP client: httpx2 (async streaming, `AsyncClient.stream` + `aiter_lines`), which
is the httpx API under another module name and is installed with transformers
(through huggingface_hub >= 2); with huggingface_hub 1.x, httpx is used instead.
No new dependency. Progress: tqdm (a transformers dependency) on stderr.
"""

import argparse
import asyncio
import dataclasses
import datetime
import json
import random
import shlex
import signal
import sys
from pathlib import Path

from bench.common import BENCH_SPEC, ROOT, bench_model, machine_summary

from bench.serving.metrics import ratios, summarize
from bench.serving.report import LABELS, format_notes, format_table, format_verdict, write_plots
from bench.serving.run import RunContext, run_trace, warm_up
from bench.serving.systems import (
    EOS_BIAS, SYSTEMS, MlxdProcess, MlxLmProcess, PromptCodecs, blas_note, http_client,
)
from bench.serving.traces import (
    KINDS, LengthDist, Trace, TraceParams, WordText, generate_trace, load_trace, save_trace,
)


def default_model() -> str:
    """The bench model with an 8192-token context (same weights as bench/common.py's,
    whose 2048 is too short for the long prompts), its tokenizer padded to one token
    per model id (see pad_tokenizer)."""
    from mlxd.model_store.tiny import build_tiny_model, default_cache_dir

    spec = dataclasses.replace(BENCH_SPEC, max_position_embeddings=8192)
    path = build_tiny_model(default_cache_dir() / "bench-llama-h512-l8-v32000-ctx8k-padded", spec)
    pad_tokenizer(path)
    return str(path)


def pad_tokenizer(model: Path) -> None:
    """Give every model id the tokenizer lacks a token of its own (`<xN>`).

    The random-weight bench model has 32000 ids but its trained tokenizer ~960
    tokens; the two servers decode the ids beyond it differently (mlxd to nothing,
    mlx_lm.server to a replacement character), which would make the multi-turn
    conversations, built from each system's own answers, grow differently."""
    import os

    from tokenizers import AddedToken, Tokenizer

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    have = tok.get_vocab_size(with_added_tokens=True)
    if have >= vocab:
        return
    tok.add_tokens([AddedToken(f"<x{i}>", special=False, normalized=False)
                    for i in range(have, vocab)])
    assert tok.token_to_id(f"<x{vocab - 1}>") == vocab - 1
    tmp = model / f".tokenizer-{os.getpid()}.json"
    tok.save(str(tmp))
    os.replace(tmp, model / "tokenizer.json")


def model_context(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("text_config", config).get("max_position_embeddings") or 0)


# ---- traces --------------------------------------------------------------------------


def trace_params(args, rate: float) -> TraceParams:
    return TraceParams(
        num_requests=args.num_requests, rate=rate,
        prompt=LengthDist(args.prompt_median, 0.8, min(16, args.max_prompt), args.max_prompt),
        output=LengthDist(args.output_median, 0.7, min(8, args.max_output), args.max_output),
        sessions=args.sessions, turns=args.turns, session_rate=args.session_rate,
        user=LengthDist(args.user_median, 0.6, min(8, args.max_prompt), args.max_prompt),
        long_count=args.long_count, long_len=args.long_len, long_output=args.long_output)


def build_traces(args, texts: WordText, header: dict) -> list[Trace]:
    if args.trace:
        return [load_trace(path) for path in args.trace]
    traces = []
    for kind in args.traces:
        rates = sorted({args.rate, *args.rates}) if kind == "poisson" else [args.rate]
        for rate in rates:
            traces.append(generate_trace(kind, trace_params(args, rate), args.seed, texts, header))
    return traces


def check_context(traces: list[Trace], context: int) -> None:
    """Exit with a clear message if a request cannot fit the model's context."""
    for trace in traces:
        if trace.kind == "multiturn":
            # a rough upper bound: every turn's message and answer plus template tokens
            for turns in trace.sessions():
                need = sum(t.user_tokens + t.output_tokens + 8 for t in turns)
                if need > context:
                    sys.exit(f"{trace.name}: a session needs ~{need} tokens, more than the "
                             f"model's context ({context}); lower --turns or the lengths")
            continue
        longest = max(trace.requests, key=lambda r: r.prompt_tokens + r.output_tokens)
        if longest.prompt_tokens + longest.output_tokens > context:
            sys.exit(f"{trace.name}: request {longest.id} needs {longest.prompt_tokens} + "
                     f"{longest.output_tokens} tokens, more than the model's context "
                     f"({context}); lower --long-len / --max-prompt or use a longer-context model")


# ---- running ------------------------------------------------------------------------


def start_system(system: str, model: str, args):
    if system in ("mlxd", "mlxd_http"):
        return MlxdProcess(model, shlex.split(args.mlxd_args))
    if system == "mlxd_padded":
        return MlxdProcess(model, shlex.split(args.mlxd_args) + ["--decode-layout", "padded"])
    if system == "mlxd_kv8":
        return MlxdProcess(model, shlex.split(args.mlxd_args) + ["--kv-bits", "8"])
    return MlxLmProcess(model, shlex.split(args.mlx_lm_args))


async def drive_system(system: str, proc, traces: list[Trace], args, codecs: PromptCodecs,
                       warm_prompt: str, progress) -> dict:
    driver = (proc.driver(args.timeout) if system in ("mlxd", "mlxd_padded", "mlxd_kv8") else
              proc.http_driver(args.timeout) if system == "mlxd_http" else
              proc.driver(args.timeout, codecs.mlx_lm_eos_ids))
    out = {}
    try:
        await warm_up(driver, warm_prompt, args.timeout)
        for trace in traces:
            progress.set_description(f"{LABELS[system]} {trace.name}")
            out[trace.name] = await drive_trace(system, proc, driver, trace, args, codecs,
                                                progress)
    finally:
        await driver.close()
    return out


async def drive_trace(system: str, proc, driver, trace: Trace, args, codecs: PromptCodecs,
                      progress) -> dict:
    """{"records", "prompt_check"}, or {"error"} if the trace could not run at all
    (failed requests do not raise; they are records with an error)."""
    ctx = RunContext(system, driver, codecs, args.timeout, proc.alive,
                     on_done=lambda record: progress.update(1))
    start = progress.n
    try:
        records = await run_trace(ctx, trace)
    except Exception as exc:
        progress.update(start + len(trace.requests) - progress.n)
        return {"error": f"{type(exc).__name__}: {exc}"}
    errors = sum(not r.ok for r in records)
    progress.write(f"{LABELS[system]} {trace.name}: {len(records)} requests, {errors} errors",
                   file=sys.stderr)
    return {"records": records, "prompt_check": dataclasses.asdict(ctx.prompts)}


def run_system(system: str, model: str, traces: list[Trace], args, codecs: PromptCodecs,
               warm_prompt: str, progress) -> dict:
    """{trace name: {"records", "prompt_check"}}, or {"error": why} if the server
    could not be started or warmed up. The server is always stopped."""
    proc, start = None, progress.n
    try:
        proc = start_system(system, model, args)
        return asyncio.run(drive_system(system, proc, traces, args, codecs, warm_prompt,
                                        progress))
    except Exception as exc:       # startup or warm-up failed: report it, go on
        progress.update(start + sum(len(t.requests) for t in traces) - progress.n)
        progress.write(f"{LABELS[system]} failed: {exc}", file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if proc is not None:
            proc.stop()


def make_progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                bar_format="{desc}{n_fmt}/{total_fmt} requests |{bar}| {elapsed}")


# ---- results --------------------------------------------------------------------------


def trace_result(trace: Trace, runs: dict[str, dict]) -> dict:
    systems = {}
    for system, run in runs.items():
        run = run if "error" in run else run[trace.name]
        if "error" in run:
            systems[system] = {"error": run["error"]}
            continue
        records = run["records"]
        first_error = next((r.error for r in records if not r.ok), None)
        systems[system] = {"metrics": summarize(records),
                           "prompt_check": run["prompt_check"],
                           "first_error": first_error,
                           "requests": [r.to_json() for r in records]}
    result = {"header": trace.header, "systems": systems}
    if all("metrics" in systems.get(s, {}) for s in ("mlxd", "mlx_lm")):
        result["ratio"] = ratios(systems["mlxd"]["metrics"], systems["mlx_lm"]["metrics"])
    if all("metrics" in systems.get(s, {}) for s in ("mlxd_http", "mlxd")):
        result["http_over_sdk"] = ratios(systems["mlxd_http"]["metrics"],
                                         systems["mlxd"]["metrics"])
    if all("metrics" in systems.get(s, {}) for s in ("mlxd_kv8", "mlxd")):
        result["kv8_over_float"] = ratios(systems["mlxd_kv8"]["metrics"],
                                          systems["mlxd"]["metrics"])
    if all("metrics" in systems.get(s, {}) for s in ("mlxd", "mlxd_padded")):
        result["paged_over_padded"] = ratios(systems["mlxd"]["metrics"],
                                             systems["mlxd_padded"]["metrics"])
    return result


def meta(args, model: str, codecs: PromptCodecs) -> dict:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_summary(), "model": model, "seed": args.seed,
        "systems": args.systems, "blas": blas_note(),
        "mlxd_args": shlex.split(args.mlxd_args), "mlx_lm_args": shlex.split(args.mlx_lm_args),
        "ignore_eos": ignore_eos_note(codecs),
        "http_client": http_client().__name__,
        "timeout_s": args.timeout,
    }


def ignore_eos_note(codecs: PromptCodecs) -> dict:
    return {"mlxd": "ignore_eos=true", "mlxd_http": "ignore_eos: true",
            "mlxd_padded": "ignore_eos=true", "mlxd_kv8": "ignore_eos=true",
            "mlx_lm": f"logit_bias {EOS_BIAS:g} on the EOS ids {codecs.mlx_lm_eos_ids} "
                      "(mlx_lm.server has no ignore_eos)"}


def write_outputs(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(format_table(results))
    print()
    verdict = format_verdict(results)
    if verdict:
        print(verdict + "\n")
    print(format_notes(results))
    paths = write_plots(results, out)
    print(f"\nwrote {out / 'results.json'}" + "".join(f", {p.name}" for p in paths))


# ---- CLI --------------------------------------------------------------------------------


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model folder, or 'smollm2'; default: the ~40M bench model, 8k context")
    ap.add_argument("--systems", type=_csv(str), default=["mlxd", "mlx_lm", "mlxd_http"],
                    help="comma-separated: mlxd,mlx_lm,mlxd_http,mlxd_padded,mlxd_kv8 (default "
                         "the first three; mlxd_http is mlxd through its HTTP API, "
                         "mlxd_padded mlxd with --decode-layout padded, mlxd_kv8 mlxd with "
                         "--kv-bits 8)")
    ap.add_argument("--traces", type=_csv(str), default=list(KINDS),
                    help=f"comma-separated kinds to generate: {','.join(KINDS)}")
    ap.add_argument("--trace", action="append", default=[],
                    help="replay this saved trace (JSONL) instead; may be repeated")
    ap.add_argument("--num-requests", type=int, default=64,
                    help="requests of burst, of each poisson rate, and of longmix")
    ap.add_argument("--rate", type=float, default=1.0, help="poisson and longmix arrivals, req/s")
    ap.add_argument("--rates", type=_csv(float), default=[0.5, 1.0, 2.0, 4.0],
                    help="poisson load sweep, req/s (also run at --rate); '' for --rate only")
    ap.add_argument("--sessions", type=int, default=8, help="multiturn sessions")
    ap.add_argument("--turns", type=int, default=4, help="turns per multiturn session")
    ap.add_argument("--session-rate", type=float, default=0.5, help="multiturn session starts/s")
    ap.add_argument("--long-len", type=int, default=4000, help="longmix long prompt tokens")
    ap.add_argument("--long-count", type=int, default=3, help="longmix long requests")
    ap.add_argument("--long-output", type=int, default=32, help="longmix long requests' output")
    ap.add_argument("--prompt-median", type=int, default=128, help="prompt tokens, median")
    ap.add_argument("--max-prompt", type=int, default=1024, help="prompt tokens, clip")
    ap.add_argument("--output-median", type=int, default=64, help="output tokens, median")
    ap.add_argument("--max-output", type=int, default=256, help="output tokens, clip")
    ap.add_argument("--user-median", type=int, default=64, help="multiturn user message tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving"),
                    help="results.json, the traces and the plots go here")
    ap.add_argument("--mlxd-args", default="--max-running-requests 32",
                    help="extra launch.py flags; a single flag needs '=': "
                         "--mlxd-args=--disable-radix-cache (default: the same 32 "
                         "concurrent requests as mlx_lm.server's default)")
    ap.add_argument("--mlx-lm-args", default="--decode-concurrency 32",
                    help="extra mlx_lm.server flags (default: its own default, 32 "
                         "concurrent requests; at 64 the kernel OOM-killed it at 24 GB "
                         "during a 64-request burst on the bench model)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a request may take, send to last token, before it "
                         "counts as an error")
    args = ap.parse_args(argv)
    unknown = [s for s in args.systems if s not in SYSTEMS] + [
        k for k in args.traces if k not in KINDS]
    if unknown or not args.systems:
        ap.error(f"unknown system or trace kind: {unknown}")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)    # so that every finally stops its server
    model = bench_model(args.model) if args.model else default_model()
    codecs = PromptCodecs(model)
    texts = WordText(codecs.mlxd.tokenizer)
    header = {"model": model, "ignore_eos": ignore_eos_note(codecs),
              "lengths": "tokens of the model's tokenizer; prompt_tokens includes BOS"}
    traces = build_traces(args, texts, header)
    check_context(traces, model_context(model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for trace in traces:
        save_trace(trace, out / f"trace-{trace.name}.jsonl")
    warm_prompt, _ = texts.prompt(16, random.Random("warm-up"))
    runs = {}
    progress = make_progress(len(args.systems) * sum(len(t.requests) for t in traces))
    try:
        for system in args.systems:
            runs[system] = run_system(system, model, traces, args, codecs, warm_prompt, progress)
    except KeyboardInterrupt:
        progress.close()
        print("interrupted; every server started was stopped", file=sys.stderr)
        return 130
    progress.close()
    results = {"meta": meta(args, model, codecs),
               "traces": {t.name: trace_result(t, runs) for t in traces}}
    write_outputs(results, out)
    # failed requests are results; a server that could not run a trace is a failure
    failed = any("error" in run for trace in results["traces"].values()
                 for run in trace["systems"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
