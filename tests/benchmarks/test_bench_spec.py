"""bench/spec.py: a small run with speculation off and ngram on a tiny model, and the
verify cost curve alone. No timing is asserted, only that every figure is there."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.spec import COUNTERS, MAX_M, TRACES
from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import processes_using, wait_until

ROOT = Path(__file__).resolve().parents[2]
# Seed 6's greedy output falls into a short loop on every trace, so n-gram drafts find
# matches; the traces' prompts run to ~3,500 of its tokens.
TINY = TinySpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, vocab_size=512, max_position_embeddings=8192, seed=6)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("spec") / "tiny", TINY))


@pytest.fixture(scope="module")
def speculative_launcher():
    shown = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    if "--speculative" not in shown.stdout:
        pytest.skip("the launcher has no --speculative flag yet (launch.py --help)")


def run_bench(tiny_model: str, out: Path, *args: str, timeout: int = 240) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.spec", "--model", tiny_model, "--cost-context", "128",
         "--cost-repeats", "1", "--json", str(out), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"bench/spec.py timed out:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


def check_cost_curve(curve: list[dict]) -> None:
    assert [e["m"] for e in curve] == list(range(1, MAX_M + 1))
    assert all(e["ms"] > 0 and e["cost_ratio"] > 0 for e in curve)
    assert curve[0]["cost_ratio"] == pytest.approx(1.0)
    assert curve[0]["break_even_accepted"] is None
    for e in curve[1:]:
        assert e["break_even_accepted"] == pytest.approx(e["cost_ratio"] - 1)
        assert e["break_even_acceptance"] == pytest.approx((e["cost_ratio"] - 1) / (e["m"] - 1))


def test_cost_curve_alone(tiny_model, tmp_path):
    out = tmp_path / "curve.json"
    stdout = run_bench(tiny_model, out, "--cost-curve-only", timeout=120)
    report = json.loads(out.read_text())
    assert "traces" not in report and report["machine"]
    check_cost_curve(report["cost_curve"])
    assert "break-even" in stdout


def check_counters(run: dict, mode: str) -> None:
    assert run["method"] == mode
    assert all(isinstance(run[k], int) and run[k] >= 0 for k in COUNTERS), run
    assert run["accepted_tokens"] <= run["draft_tokens"]
    if mode == "off":
        assert run["verifies"] == run["draft_tokens"] == 0


def test_spec_bench_runs_off_and_ngram_and_reports_every_figure(
        speculative_launcher, tiny_model, tmp_path):
    out = tmp_path / "spec.json"
    stdout = run_bench(tiny_model, out, "--concurrency", "1,2", "--gen-len", "16",
                       "--repeats", "1")
    report = json.loads(out.read_text())
    assert report["inputs"]["concurrency"] == [1, 2] and report["machine"]
    assert set(report["traces"]) == set(TRACES)
    verified = 0
    for name, levels in report["traces"].items():
        assert set(levels) == {"1", "2"}
        for n, entry in levels.items():
            (repeat,) = entry["repeats"]
            for mode, run in repeat.items():
                assert run["tok_s"] > 0 and run["completion_tokens"] == [16] * int(n)
                check_counters(run, mode)
            s = entry["summary"]
            assert s["tok_s_off"] > 0 and s["tok_s_ngram"] > 0
            assert s["ratio"] == pytest.approx(s["tok_s_ngram"] / s["tok_s_off"])
            assert all(s[k] == repeat["ngram"][k] for k in COUNTERS)
            if s["verifies"]:
                assert s["tokens_per_verify"] == pytest.approx(
                    1 + s["accepted_tokens"] / s["verifies"])
            verified += s["verifies"]
    assert verified > 0   # the tiny model's looping output gives the drafts matches
    check_cost_curve(report["cost_curve"])
    assert "tok/step" in stdout and "break-even" in stdout
    # no server or cost-curve child is left behind
    assert wait_until(lambda: not processes_using(tiny_model), 10), processes_using(tiny_model)


def test_spec_bench_compares_off_with_a_draft_model(tiny_model, tmp_path):
    """--draft-model: the second server runs `--speculative draft` on a draft made of
    the model's first layer (bench/truncated_draft.py); the same figures, under its
    name, and the same greedy tokens as off."""
    from bench.truncated_draft import truncated_copy

    draft = truncated_copy(tiny_model, tmp_path / "draft", layers=1)
    out = tmp_path / "spec.json"
    stdout = run_bench(tiny_model, out, "--concurrency", "1", "--gen-len", "12",
                       "--repeats", "1", "--traces", "edit", "--draft-model", str(draft),
                       "--server-args", "--spec-cost none")
    report = json.loads(out.read_text())
    assert report["inputs"]["draft_model"] == str(draft)
    entry = report["traces"]["edit"]["1"]
    (repeat,) = entry["repeats"]
    assert set(repeat) == {"off", "draft"}
    for mode, run in repeat.items():
        check_counters(run, mode)
    s = entry["summary"]
    assert s["tok_s_off"] > 0 and s["tok_s_draft"] > 0 and s["verifies"] > 0
    assert s["same_tokens"]
    assert "draft" in stdout.splitlines()[2]   # the table's column
    assert wait_until(lambda: not processes_using(tiny_model), 10), processes_using(tiny_model)


def test_a_truncated_draft_keeps_the_first_layers_and_the_vocabulary(tiny_model, tmp_path):
    from bench.truncated_draft import truncated_copy
    from mlxd.worker_proc.draft_model import check_draft, same_vocabulary
    from mlxd.worker_proc.model_runner import probe_geometry, probe_vocab_size
    from support import load_reference

    draft = truncated_copy(tiny_model, tmp_path / "draft", layers=1)
    model, tokenizer = load_reference(tiny_model)
    small, small_tokenizer = load_reference(str(draft))
    assert len(small.layers) == 1 and len(model.layers) == 2
    check_draft(probe_geometry(small), probe_vocab_size(small), probe_vocab_size(model))
    assert same_vocabulary(tokenizer._tokenizer, small_tokenizer._tokenizer)
    assert (small.layers[0].self_attn.q_proj.weight == model.layers[0].self_attn.q_proj.weight).all()
    with pytest.raises(ValueError, match="layers"):
        truncated_copy(tiny_model, tmp_path / "bad", layers=3)
