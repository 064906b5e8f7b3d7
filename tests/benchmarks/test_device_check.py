"""The GPU check's pieces that run anywhere: the wheels cut into call folders and joined
back (bench/device_wheels.sh, bench/device_check.sh), its test list, and the table
(bench/device_report.py) read from hand-made outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.device_report import parse_pytest_log, report
from bench.serving.metrics import RequestRecord, ratios, summarize

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def bash(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / script), *args], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


# ---- wheels: cut into calls, joined back ----------------------------------------------


@pytest.fixture
def wheels(tmp_path):
    """Three fake wheels, one larger than a 1 MiB call, in WHEELS/all."""
    all_ = tmp_path / "whl" / "all"
    all_.mkdir(parents=True)
    sizes = {"big-1.0-py3-none-any.whl": 2 * MiB + 12345, "mid-1.0-py3-none-any.whl": MiB // 2,
             "small-1.0-py3-none-any.whl": 300_000}
    for name, size in sizes.items():
        (all_ / name).write_bytes(os.urandom(size))
    env = {"MLXD_WHEELS_DIR": str(tmp_path / "whl"), "MLXD_WHEELS_CALL_MIB": "1",
           "MLXD_WHEELS_STAGE": str(tmp_path / "stage"),
           "MLXD_WHEELS_TREE": str(small_checkout(tmp_path / "tree"))}
    return all_, env


def small_checkout(path: Path, untracked_bytes: int = 0) -> Path:
    """A git checkout of one small tracked file (and an untracked one of
    `untracked_bytes`): what a call sends besides its wheels, whatever lies in ours."""
    path.mkdir()
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "README.md").write_text("tree\n")
    subprocess.run(["git", "-C", str(path), "add", "README.md"], check=True)
    if untracked_bytes:
        (path / "data.bin").write_bytes(b"\0" * untracked_bytes)
    return path


def test_wheels_are_packed_into_calls_that_fit(wheels):
    all_, env = wheels
    done = bash("device_wheels.sh", "--split", env=env)
    assert done.returncode == 0, done.stderr
    calls = sorted(all_.parent.glob("call*"))
    assert len(calls) == 3          # the big wheel's two full parts, then all the rest
    for call in calls:
        wheels_bytes = sum(f.stat().st_size for f in call.iterdir() if f.suffix != ".sha256")
        assert wheels_bytes <= MiB
        assert (call / "MANIFEST.sha256").exists()
    commands = [line for line in done.stdout.splitlines() if "command:" in line]
    assert len(commands) == len(calls)
    assert commands[-1].endswith(f"stage {len(calls)} && bash bench/device_check.sh check")


def test_a_call_that_would_not_fit_beside_the_checkout_is_refused(wheels, tmp_path):
    """The checkout's untracked, unignored files travel with every call, so they count."""
    _, env = wheels
    env["MLXD_WHEELS_TREE"] = str(small_checkout(tmp_path / "big", 63 * MiB + MiB // 2))
    done = bash("device_wheels.sh", "--split", env=env)
    assert done.returncode != 0 and "would send 64 MiB" in done.stderr


@pytest.mark.parametrize("folder", [".venv", "venv", "env"])
def test_a_virtual_environment_in_the_checkout_is_ignored(folder):
    """`python3 -m venv .venv` inside the checkout: git, and so the device calls'
    size, never count it."""
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{folder}/lib/site.py"], cwd=ROOT)
    assert ignored.returncode == 0


def test_staged_calls_join_into_the_wheels_and_a_missing_call_is_named(wheels):
    all_, env = wheels
    assert bash("device_wheels.sh", "--split", env=env).returncode == 0
    calls = sorted(all_.parent.glob("call*"))
    for n in range(2, len(calls) + 1):                  # call 1 skipped
        assert bash("device_check.sh", "stage", str(n), env=env).returncode == 0
    missing = bash("device_check.sh", "join", env=env)
    assert missing.returncode == 2 and "make every call again, from call 1" in missing.stderr
    assert bash("device_check.sh", "stage", "1", env=env).returncode == 0
    joined = bash("device_check.sh", "join", env=env)
    assert joined.returncode == 0, joined.stderr
    stage = Path(env["MLXD_WHEELS_STAGE"])
    for wheel in all_.glob("*.whl"):
        assert (stage / wheel.name).read_bytes() == wheel.read_bytes()


def test_stage_without_its_call_folder_says_what_to_carry(wheels):
    _, env = wheels
    done = bash("device_check.sh", "stage", "7", env=env)
    assert done.returncode == 2 and '[".whl/call7"]' in done.stderr


@pytest.mark.parametrize("mode", [[], ["--cpu-smoke"]], ids=["gpu", "cpu-smoke"])
def test_the_listed_tests_exist(mode):
    ids = bash("device_check.sh", "list-tests", *mode).stdout.split("\n")[:-1]
    assert ids
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stdout[-2000:]
    assert len([line for line in collected.stdout.splitlines() if "::" in line]) >= len(ids)


# ---- the table -----------------------------------------------------------------------

LOG = """\
============================= test session starts ==============================
collected 6 items

tests/worker/test_a.py::test_exact[llama_model] PASSED                   [ 16%]
tests/worker/test_a.py::test_exact[qwen3_model] FAILED                   [ 33%]
tests/server/test_b.py::test_bad[kwargs17-exactly one] PASSED            [ 50%]
tests/server/test_b.py::test_served PASSED                               [ 66%]
tests/server/test_b.py::test_served ERROR                                [ 66%]
tests/server/test_b.py::test_later SKIPPED (no model)                    [ 83%]
"""
SUMMARY = "========= 1 failed, 3 passed, 1 skipped, 1 error in 12.34s =========\n"


def test_pytest_outcomes_count_each_test_once_at_its_worst():
    counts = parse_pytest_log(LOG + "tests/server/test_b.py::test_last XFAIL\n" + SUMMARY)
    assert counts.finished and counts.collected == 6
    assert counts.ids("FAILED") == ["tests/worker/test_a.py::test_exact[qwen3_model]"]
    assert counts.ids("ERROR") == ["tests/server/test_b.py::test_served"]   # teardown error
    assert "tests/server/test_b.py::test_bad[kwargs17-exactly one]" in counts.ids("PASSED")
    assert counts.summary() == "2 passed, 1 failed, 1 errors, 2 skipped"


def test_a_run_stopped_at_its_limit_counts_what_ran():
    counts = parse_pytest_log(LOG)
    assert not counts.finished
    assert counts.summary() == "2 passed, 1 failed, 1 errors, 1 skipped; 5 of 6 ran"


def _record(rid: str, sent: float, times: list[float], out: int) -> RequestRecord:
    r = RequestRecord(rid, sent, out, chunk_times=times, chunk_tokens=[1] * len(times),
                      done=times[-1], prompt_tokens=10, output_tokens=out,
                      finish_reason="length")
    r.check()
    return r


def _serving_results(mlxd_gap: float) -> dict:
    """A burst trace as bench.serving saves it: mlxd streams with `mlxd_gap` s between
    tokens, mlx_lm with 0.2 s."""
    runs = {"mlxd": [_record("a", 0.0, [0.1 + i * mlxd_gap for i in range(5)], 5)],
            "mlx_lm": [_record("a", 0.0, [0.4 + i * 0.2 for i in range(5)], 5)]}
    metrics = {system: summarize(records) for system, records in runs.items()}
    systems = {s: {"metrics": m, "prompt_check": {}, "first_error": None, "requests": []}
               for s, m in metrics.items()}
    return {"traces": {"burst": {"header": {"kind": "burst"}, "systems": systems,
                                 "ratio": ratios(metrics["mlxd"], metrics["mlx_lm"])}}}


@pytest.fixture
def work(tmp_path):
    """A check's work folder after a run whose longmix part hit its limit."""
    (tmp_path / "device.txt").write_text(
        "date: 2026-12-01 00:00 UTC\ngpu: NVIDIA H200, 143771 MiB, 580.159.04\n"
        "mlx: 0.32.4\nmlx device: Device(gpu, 0)\nmlx-lm: 0.32.2\n")
    (tmp_path / "parts.tsv").write_text(
        "tests 1 150\nthroughput 0 95\nserving-burst 0 70\nserving-longmix 124 130\n")
    (tmp_path / "tests.log").write_text(LOG + SUMMARY)
    (tmp_path / "throughput.json").write_text(json.dumps({
        "n": 64, "prompt_len": 128, "gen_len": 256, "batch_generator_tok_s": 2000.0,
        "mlxd_tok_s": 1900.0, "mlxd_no_overlap_tok_s": 1500.0, "ratio": 0.95,
        "ratio_no_overlap": 0.75}))
    (tmp_path / "serving-burst").mkdir()
    (tmp_path / "serving-burst" / "results.json").write_text(json.dumps(_serving_results(0.1)))
    return tmp_path


def _row(table: str, part: str, system: str | None = None) -> list[str]:
    """The cells of the one table row whose part starts with `part` (and whose system
    is `system`, if given)."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ")]
    found = [row for row in rows
             if row[0].startswith(part) and system in (None, row[1])]
    assert len(found) == 1, (part, system, table)
    return found[0]


def test_the_table_shows_every_part(work):
    table = report(work, work)
    assert table.startswith("GPU check, 2026-12-01 00:00 UTC: NVIDIA H200")
    assert "Device(gpu, 0)" in table.splitlines()[0]
    assert _row(table, "token-exact tests (150 s, exit 1)")[2] == (
        "2 passed, 1 failed, 1 errors, 1 skipped")
    throughput = "throughput N=64 P=128 G=256 (95 s)"
    assert _row(table, throughput, "mlx_lm BatchGenerator")[2:4] == ["baseline", "2000.0"]
    assert _row(table, throughput, "mlxd")[2:4] == ["0.95x baseline", "1900.0"]
    assert _row(table, throughput, "mlxd --disable-overlap")[2:4] == ["0.75x baseline", "1500.0"]
    mlxd = _row(table, "serving burst (70 s)", "mlxd")
    assert mlxd[2:4] == ["1/1 requests", "10.00"]        # 5 tokens in 0.5 s
    assert mlxd[4] == mlxd[6] == "100ms"                 # TTFT p50, ITL p50
    assert _row(table, "serving burst", "mlx_lm.server")[6] == "200ms"
    assert _row(table, "serving burst", "mlxd / mlx_lm")[6] == "0.50x"
    assert _row(table, "serving longmix")[2] == "no results (stopped at its limit, 130 s)"
    assert "- tests/worker/test_a.py::test_exact[qwen3_model]" in table
    assert "- tests/server/test_b.py::test_served" in table


def test_parts_that_never_ran_say_so(tmp_path):
    table = report(tmp_path, tmp_path)
    assert "no device description" in table
    assert _row(table, "token-exact tests")[2] == "not run"
    assert _row(table, "throughput")[2] == "not run"
