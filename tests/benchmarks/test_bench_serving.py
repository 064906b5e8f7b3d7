"""bench/serving/ (python -m bench.serving): its pure parts (traces, metrics) and a small run against mlxd."""

import importlib.util
import json
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import processes_using, wait_until

ROOT = Path(__file__).resolve().parents[2]
from bench.serving.metrics import (
    METRIC_KEYS, RequestRecord, itl_samples, percentile, ratios, summarize,
)
from bench.serving.traces import (
    KINDS, LengthDist, TraceParams, WordText, generate_trace, load_trace, save_trace,
)

TINY = TinySpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, vocab_size=512, max_position_embeddings=2048)


class FakeText:
    """Every word is one token; prompts get one more (a BOS)."""

    WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]

    def message(self, n, rng):
        return " ".join(rng.choice(self.WORDS) for _ in range(n)), n

    def prompt(self, n, rng):
        text, _ = self.message(n - 1, rng)
        return text, n


SMALL = TraceParams(num_requests=12, rate=2.0, prompt=LengthDist(20, 0.8, 4, 60),
                    output=LengthDist(10, 0.7, 2, 40), sessions=3, turns=3,
                    user=LengthDist(8, 0.6, 2, 30), long_count=2, long_len=500)


def dump(trace):
    return trace.header, [asdict(r) for r in trace.requests]


# ---- traces ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_trace_is_deterministic_for_a_seed_and_round_trips(kind, tmp_path):
    trace = generate_trace(kind, SMALL, seed=3, texts=FakeText(), extra_header={"note": "x"})
    assert dump(trace) == dump(generate_trace(kind, SMALL, 3, FakeText(), {"note": "x"}))
    assert dump(trace) != dump(generate_trace(kind, SMALL, 4, FakeText(), {"note": "x"}))
    save_trace(trace, tmp_path / "t.jsonl")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 1 + len(trace.requests)
    header = json.loads(lines[0])
    assert header["kind"] == kind and header["seed"] == 3 and header["note"] == "x"
    assert dump(load_trace(tmp_path / "t.jsonl")) == dump(trace)


def test_trace_shapes():
    burst = generate_trace("burst", SMALL, 0, FakeText())
    assert len(burst.requests) == 12 and all(r.arrival == 0 for r in burst.requests)
    assert all(4 <= r.prompt_tokens <= 60 and 2 <= r.output_tokens <= 40 for r in burst.requests)

    poisson = generate_trace("poisson", SMALL, 0, FakeText())
    arrivals = [r.arrival for r in poisson.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert poisson.name == "poisson-r2"

    sessions = generate_trace("multiturn", SMALL, 0, FakeText()).sessions()
    assert [[(r.session, r.turn) for r in s] for s in sessions] == [
        [(i, t) for t in range(3)] for i in range(3)]
    assert all(r.user and r.user_tokens >= 2 for s in sessions for r in s)

    longmix = generate_trace("longmix", SMALL, 0, FakeText())
    long = [r for r in longmix.requests if r.tag == "long"]
    assert len(long) == 2 and longmix.requests[0].tag == "short"
    assert all(475 <= r.prompt_tokens <= 500 for r in long)


def test_poisson_rates_share_lengths_but_not_text():
    slow = generate_trace("poisson", SMALL, 0, FakeText())
    fast = generate_trace("poisson", replace(SMALL, rate=4.0), 0, FakeText())
    assert [r.output_tokens for r in slow.requests] == [r.output_tokens for r in fast.requests]
    assert [r.prompt_tokens for r in slow.requests] == [r.prompt_tokens for r in fast.requests]
    assert [r.arrival for r in fast.requests] == pytest.approx(
        [r.arrival / 2 for r in slow.requests], abs=1e-5)
    assert sum(a.prompt == b.prompt for a, b in zip(slow.requests, fast.requests)) <= 1


def test_load_trace_rejects_what_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "r0", "arrival": 0, "output_tokens": 4, "prompt": "x"}\n')
    with pytest.raises(ValueError, match="header"):
        load_trace(bad)
    trace = generate_trace("burst", SMALL, 0, FakeText())
    save_trace(trace, bad)
    bad.write_text(bad.read_text() + '{"id": "r99", "arrival": 0, "output_tokens": 4}\n')
    with pytest.raises(ValueError, match="r99"):
        load_trace(bad)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("serving") / "tiny", TINY))


def test_word_text_makes_exact_token_counts(tiny_model):
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = WordText(tokenizer)
    rng = random.Random(0)
    for n in (1, 2, 7, 64, 300):
        if n > texts.special:    # a prompt has its BOS and at least one word
            text, count = texts.prompt(n, rng)
            assert count == n == len(tokenizer.encode(text))
        text, count = texts.message(n, rng)
        assert count == n == len(tokenizer.encode(text, add_special_tokens=False))


# ---- metrics -----------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_itl_is_per_token():
    # chunks at 0, 1, 1.5, 3.5 s carrying 1, 1, 1, 2 tokens: the first is TTFT
    assert itl_samples([0, 1, 1.5, 3.5], [1, 1, 1, 2], 5) == pytest.approx([1, 0.5, 1, 1])
    assert itl_samples([2.0], [3], 3) == []
    # sizes unknown (SSE text), one token per chunk: each gap is one token's
    assert itl_samples([0, 1, 3], [None] * 3, 3) == pytest.approx([1.0, 2.0])
    # 3 tokens more than chunks: they go to the gap that is longest per token,
    # first the 2 s gap, then (ties to the earlier) the two 1 s gaps
    assert itl_samples([0, 1, 2, 4], [None] * 4, 7) == pytest.approx([0.5, 0.5, 0.5, 0.5, 1, 1])
    # a 0-token chunk (text only) adds no value
    assert itl_samples([0, 1, 2], [1, 0, 1], 2) == pytest.approx([1.0])


def record(rid, sent, times, tokens, done, out, expected=None):
    r = RequestRecord(rid, sent, expected or out, expected_prompt_tokens=10,
                      chunk_times=times, chunk_tokens=tokens, done=done, prompt_tokens=10,
                      output_tokens=out, finish_reason="length")
    r.check()
    return r


def test_summarize_hand_made_records():
    a = record("a", 0.0, [0.5, 1.0, 1.5], [1, 1, 1], 1.5, 3)
    b = record("b", 1.0, [1.2, 1.4, 2.0], [1, 1, 2], 2.0, 4)
    short = record("c", 0.0, [0.1], [2], 0.1, 2, expected=5)     # fewer tokens than drawn
    lost = RequestRecord("d", 0.0, 5, error="ConnectError: refused")
    assert a.ok and b.ok and not short.ok and "5 asked" in short.error
    m = summarize([a, b, short, lost])
    assert set(METRIC_KEYS) <= set(m)
    assert (m["requests"], m["completed"], m["errors"]) == (4, 2, 2)
    assert m["duration_s"] == 2.0
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["ttft_p50"] == pytest.approx(0.35)          # TTFTs 0.5 and 0.2
    assert m["e2e_p50"] == pytest.approx(1.25)           # E2Es 1.5 and 1.0
    # ITLs: a: 0.5, 0.5; b: 0.2, then 0.6 over 2 tokens = 0.3, 0.3
    assert m["itl_p50"] == pytest.approx(0.3)
    assert m["itl_p99"] == pytest.approx(0.5)
    assert m["output_token_mismatches"] == 1 and m["prompt_token_mismatches"] == 0


def test_streamed_tokens_must_match_usage():
    r = record("a", 0.0, [0.5, 1.0], [1, 1], 1.0, 3)
    assert not r.ok and "usage says 3" in r.error


def test_ratios_are_mlxd_over_mlx_lm():
    ours = {"output_throughput": 200.0, "ttft_p50": 0.5, "errors": 0}
    theirs = {"output_throughput": 100.0, "ttft_p50": 1.0, "errors": 0}
    r = ratios(ours, theirs)
    assert r["output_throughput"] == 2.0 and r["ttft_p50"] == 0.5
    assert r["errors"] is None and r["itl_p50"] is None


# ---- a real run against mlxd -------------------------------------------------------


def run_bench(args: list[str], timeout: float = 150.0) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "bench.serving", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)     # the bench stops its servers on SIGTERM
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"bench.serving timed out:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


SMOKE = ["--systems", "mlxd", "--num-requests", "6", "--rate", "8", "--rates", "4",
         "--sessions", "2", "--turns", "3", "--session-rate", "4", "--long-len", "200",
         "--long-count", "1", "--long-output", "8", "--prompt-median", "16", "--max-prompt", "48",
         "--output-median", "6", "--max-output", "12", "--user-median", "8", "--timeout", "60"]


def test_serving_bench_against_mlxd(tiny_model, tmp_path):
    out = tmp_path / "out"
    result = run_bench(["--model", tiny_model, "--out", str(out), *SMOKE])
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    names = {"burst", "poisson-r4", "poisson-r8", "multiturn", "longmix"}
    assert set(results["traces"]) == names
    for name, trace_result in results["traces"].items():
        trace = load_trace(out / f"trace-{name}.jsonl")
        assert trace.header == trace_result["header"]
        run = trace_result["systems"]["mlxd"]
        metrics = run["metrics"]
        missing = [k for k in METRIC_KEYS if metrics.get(k) is None]
        assert not missing, (name, missing)
        assert metrics["errors"] == 0, (name, run["first_error"])
        assert metrics["output_token_mismatches"] == metrics["prompt_token_mismatches"] == 0
        checks = run["prompt_check"]
        assert checks["checked"] == checks["identical"] == len(trace.requests), name
        drawn = {r.id: r.output_tokens for r in trace.requests}
        got = {r["id"]: r["output_tokens"] for r in run["requests"]}
        assert got == drawn, name
        assert all(sum(r["chunk_tokens"]) == r["output_tokens"] for r in run["requests"])
    multiturn = results["traces"]["multiturn"]["systems"]["mlxd"]["requests"]
    assert any(r["cached_tokens"] > 1 for r in multiturn)    # later turns reuse the prefix
    assert "mlxd" in result.stdout and "TTFT p50" in result.stdout
    if importlib.util.find_spec("matplotlib"):     # an optional extra: plots only with it
        assert {p.name for p in out.glob("*.png")} == {
            *(f"cdf_{name}.png" for name in names), "throughput_vs_load.png"}
    assert wait_until(lambda: not processes_using(tiny_model), 10), processes_using(tiny_model)

    # The saved trace replays: same requests, same token counts, also in the padded
    # decode layout (compared with the paged one in the same run).
    again = tmp_path / "again"
    result = run_bench(["--model", tiny_model, "--out", str(again), "--systems",
                        "mlxd,mlxd_padded", "--trace", str(out / "trace-burst.jsonl")])
    assert result.returncode == 0, result.stderr[-3000:]
    burst = json.loads((again / "results.json").read_text())["traces"]["burst"]
    first = results["traces"]["burst"]["systems"]["mlxd"]["requests"]
    for system in ("mlxd", "mlxd_padded"):
        replay = burst["systems"][system]
        assert replay["metrics"]["errors"] == 0, replay["first_error"]
        assert [(r["id"], r["prompt_tokens"], r["output_tokens"])
                for r in replay["requests"]] == [
            (r["id"], r["prompt_tokens"], r["output_tokens"]) for r in first]
    assert burst["paged_over_padded"]["output_throughput"] > 0
    assert "paged/padded" in result.stdout and "mlxd (padded)" in result.stdout
    assert wait_until(lambda: not processes_using(tiny_model), 10), processes_using(tiny_model)
