"""The GPU check's one table (bench/device_check.sh), and the device description it opens with.

    python -m bench.device_report info                  # "key: value" lines: MLX, its device
    python -m bench.device_report table WORK [--logs DIR] [--out FILE]   # the table

WORK is the check's work folder: device.txt ("key: value" lines), parts.tsv ("part rc
seconds" per part run), throughput.json (bench.throughput --json) and
serving-*/results.json (bench.serving --out); tests.log (pytest -v) is in --logs. A
part that was cut short or failed shows as such, with whatever figures it left.
"""

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.serving.report import LABELS, format_metric, format_notes

COLUMNS = ["part", "system", "result", "out tok/s", "TTFT p50", "TTFT p90", "ITL p50",
           "ITL p90", "ITL p99", "E2E p99", "errors"]
SERVING_KEYS = ["output_throughput", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "itl_p99",
                "e2e_p99", "errors"]
TIMED_OUT = (124, 137)   # timeout(1): the limit was reached; 137: killed after it


# ---- reading the parts --------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    rc: int
    seconds: int

    def status(self) -> str:
        if self.rc in TIMED_OUT:
            return f"stopped at its limit, {self.seconds} s"
        return f"{self.seconds} s" + ("" if self.rc == 0 else f", exit {self.rc}")


def read_parts(path: Path) -> dict[str, Part]:
    """parts.tsv: one "name rc seconds" line per part that ran."""
    parts = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds = line.split()
            parts[name] = Part(int(rc), int(seconds))
    return parts


def read_keys(path: Path) -> dict[str, str]:
    """"key: value" lines (device.txt)."""
    if not path.exists():
        return {}
    pairs = (line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


@dataclass
class TestCounts:
    collected: int | None = None
    outcomes: dict[str, str] = field(default_factory=dict)   # test id -> worst outcome
    finished: bool = False                                   # pytest printed its summary

    def ids(self, outcome: str) -> list[str]:
        return [test for test, got in self.outcomes.items() if got == outcome]

    def summary(self) -> str:
        counts = {o: len(self.ids(o)) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        text = (f"{counts['PASSED']} passed, {counts['FAILED']} failed, {counts['ERROR']} "
                f"errors, {counts['SKIPPED']} skipped")
        if not self.finished and self.collected is not None:
            text += f"; {len(self.outcomes)} of {self.collected} ran"
        return text


OUTCOME = re.compile(r"^(tests/\S.*?::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 3}
AS = {"XPASS": "PASSED", "XFAIL": "SKIPPED"}


def parse_pytest_log(text: str) -> TestCounts:
    """Outcomes from `pytest -v` lines ("tests/x.py::test_y[p] PASSED   [ 5%]"), kept
    line by line so that a run stopped at its limit still counts what ran. A test that
    passed and then errored in teardown counts as an error."""
    counts = TestCounts()
    for line in text.splitlines():
        if found := re.match(r"collected (\d+) items?", line):
            counts.collected = int(found.group(1))
        elif found := OUTCOME.match(line):
            test, got = found.group(1), AS.get(found.group(2), found.group(2))
            before = counts.outcomes.get(test, "PASSED")
            counts.outcomes[test] = max(before, got, key=RANK.__getitem__)
        elif re.match(r"^=+ .*\bin [\d.]+s\b.* =+$", line):
            counts.finished = True
    return counts


def read_serving(work: Path) -> dict:
    """The traces of every serving-*/results.json, in one results dict."""
    traces = {}
    for path in sorted(work.glob("serving-*/results.json")):
        traces.update(json.loads(path.read_text())["traces"])
    return {"traces": traces}


# ---- the table ----------------------------------------------------------------------


def test_rows(part: Part | None, counts: TestCounts) -> list[list[str]]:
    if part is None:
        return [["token-exact tests", "-", "not run"]]
    return [[f"token-exact tests ({part.status()})", "-", counts.summary()]]


def throughput_rows(part: Part | None, figures: dict | None) -> list[list[str]]:
    """bench.throughput's three systems, each as a ratio to the in-process baseline."""
    if figures is None:
        return [["throughput", "-", "not run" if part is None else
                 f"no results ({part.status()})"]]
    where = (f"throughput N={figures['n']} P={figures['prompt_len']} G={figures['gen_len']}"
             + (f" ({part.status()})" if part else ""))
    base = figures["batch_generator_tok_s"]
    return [[where, "mlx_lm BatchGenerator", "baseline", f"{base:.1f}"],
            [where, "mlxd", f"{figures['ratio']:.2f}x baseline", f"{figures['mlxd_tok_s']:.1f}"],
            [where, "mlxd --disable-overlap", f"{figures['ratio_no_overlap']:.2f}x baseline",
             f"{figures['mlxd_no_overlap_tok_s']:.1f}"]]


def serving_rows(parts: dict[str, Part], results: dict) -> list[list[str]]:
    rows = []
    for name, trace in results["traces"].items():
        part = parts.get(f"serving-{name}")
        where = f"serving {name}" + (f" ({part.status()})" if part else "")
        for system, run in trace["systems"].items():
            label = LABELS.get(system, system)
            if "metrics" not in run:
                first = (run.get("error") or "?").splitlines()[0][:120]
                rows.append([where, label, f"failed: {first}"])
                continue
            m = run["metrics"]
            rows.append([where, label, f"{m['completed']}/{m['requests']} requests"] +
                        [format_metric(key, m.get(key)) for key in SERVING_KEYS])
        if trace.get("ratio"):
            rows.append([where, "mlxd / mlx_lm", "ratio"] +
                        [_ratio(trace["ratio"].get(key)) for key in SERVING_KEYS])
    return rows


def missing_serving_rows(parts: dict[str, Part], results: dict) -> list[list[str]]:
    """A row for every serving part that left no results (stopped or failed early)."""
    return [[f"serving {name.removeprefix('serving-')}", "-", f"no results ({part.status()})"]
            for name, part in parts.items()
            if name.startswith("serving-") and name.removeprefix("serving-")
            not in results["traces"]]


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = row + ["-"] * (len(COLUMNS) - len(row))
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


def heading(device: dict[str, str]) -> str:
    if not device:
        return "GPU check: no device description (device.txt)"
    keys = ("mlx", "mlx-lm", "transformers", "python")
    versions = ", ".join(f"{k} {device[k]}" for k in keys if k in device)
    return (f"GPU check, {device.get('date', '?')}: {device.get('gpu', '?')}; MLX on "
            f"{device.get('mlx device', '?')}; {versions}")


def report(work: Path, logs: Path) -> str:
    """The heading, the table, then the failed tests and the serving notes."""
    parts = read_parts(work / "parts.tsv")
    tests = parse_pytest_log(_read(logs / "tests.log"))
    throughput = _read(work / "throughput.json")
    figures = json.loads(throughput) if throughput else None
    serving = read_serving(work)
    rows = (test_rows(parts.get("tests"), tests)
            + throughput_rows(parts.get("throughput"), figures)
            + serving_rows(parts, serving) + missing_serving_rows(parts, serving))
    text = [heading(read_keys(work / "device.txt")), "", markdown(rows)]
    failed = tests.ids("FAILED") + tests.ids("ERROR")
    if failed:
        text += ["", "Failed tests:"] + [f"- {test}" for test in failed[:20]]
    if serving["traces"]:
        text += ["", "Serving notes: " + format_notes(serving)]
    return "\n".join(text)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# ---- the device ---------------------------------------------------------------------


def device_info() -> dict[str, str]:
    """What the check ran on, as MLX sees it (imports MLX)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    from mlxd.runtime.blas import find_blas

    info = {"python": platform.python_version(), "mlx": mx.__version__,
            "mlx device": str(mx.default_device())}
    for name in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cpu", "mlx-lm", "transformers",
                 "tokenizers", "numpy", "pyzmq"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    described = mx.device_info()
    info["mlx device name"] = str(described.get("device_name", "?"))
    if described.get("memory_size"):
        info["mlx device memory"] = f"{described['memory_size'] / 1024**3:.1f} GiB"
    info["cpu blas preloaded"] = find_blas("auto") or "none"
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info")
    table = sub.add_parser("table")
    table.add_argument("work", type=Path)
    table.add_argument("--logs", type=Path, default=None,
                       help="the folder of tests.log (default: WORK)")
    table.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if args.command == "info":
        print("\n".join(f"{key}: {value}" for key, value in device_info().items()))
        return
    text = report(args.work, args.logs or args.work)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
