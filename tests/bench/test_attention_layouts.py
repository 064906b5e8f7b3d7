"""bench/attention_layouts: every layout computes the reference's attention on tiny
shapes (ragged, shared prefix, grouped-query heads, pages split across rows), and a
quick run prints its table."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from bench.attention_layouts.attend import class_capacity, merge_partials, partial_attention
from bench.attention_layouts.cases import Case, Shape, make_batch, reference, standard_cases
from bench.attention_layouts.run import build_layouts, check, run_case

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [Shape(4, 4, 16, mx.float32), Shape(4, 2, 16, mx.float32)]   # MHA and GQA
CASES = standard_cases(scale=16) + [
    Case("E", "rows of 1, 7, 40 and 3 positions", (1, 7, 40, 3)),
    Case("F", "a 9-position prefix shared by 3 rows of different lengths", (10, 19, 30),
         prefix_len=9),
]
NAMES = {"padded", "padded, hand-written", "width classes", "per-row",
         "gather-then-attend", "paged (gather_mm)"}


@pytest.mark.parametrize("shape", SHAPES, ids=["mha", "gqa"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_layout_matches_the_reference(case, shape):
    batch = make_batch(case, shape, seed=3)
    layouts = build_layouts(batch, page=4)   # small pages: rows span several, merged
    diffs = check(layouts, batch)
    expected = NAMES | ({"cascade"} if case.prefix_len else set())
    assert set(diffs) == expected
    assert max(diffs.values()) < 1e-4


def test_check_catches_a_wrong_layout():
    batch = make_batch(standard_cases(scale=16)[1], SHAPES[0])
    layouts = build_layouts(batch, page=4)
    broken = layouts[2]
    broken.step = lambda: mx.zeros_like(batch.q)   # the class outputs lost
    with pytest.raises(AssertionError, match="width classes"):
        check(layouts, batch)


def test_reference_is_softmax_attention():
    batch = make_batch(Case("R", "one row", (5,)), SHAPES[0], seed=1)
    k, v = batch.rows[0]
    q = batch.q[0]   # [H, 1, D]
    weights = mx.softmax((q @ k.swapaxes(-1, -2)) * batch.shape.scale, axis=-1)
    assert mx.allclose(reference(batch)[0], weights @ v, atol=1e-6)


def test_merged_partials_equal_attention_over_the_union():
    keys = mx.random.split(mx.random.key(5), 3)
    q = mx.random.normal((2, 1, 8), key=keys[0])
    k = mx.random.normal((2, 10, 8), key=keys[1])
    v = mx.random.normal((2, 10, 8), key=keys[2])
    whole, _ = partial_attention(q, k, v, 0.3)
    merged = merge_partials(partial_attention(q, k[:, :4], v[:, :4], 0.3),
                            partial_attention(q, k[:, 4:], v[:, 4:], 0.3))
    assert mx.allclose(whole, merged, atol=1e-6)


def test_width_classes_are_powers_of_two_with_room():
    assert [class_capacity(n) for n in (1, 254, 255, 256, 1024, 1280, 4096)] == \
        [256, 256, 512, 512, 2048, 2048, 8192]


def test_joins_are_measured_and_only_padded_copies_the_batch():
    (result,) = [r for r in run_case(standard_cases(scale=16)[3], SHAPES[0], 1, 0, 4)
                 if r.layout == "padded"]
    assert result.join_ms is not None
    batch = make_batch(standard_cases(scale=16)[3], SHAPES[0])
    for layout in build_layouts(batch, page=4):
        written = layout.join(*batch.join_row)
        assert written is not None, layout.name
        held = layout.held()
        if layout.name.startswith("padded"):   # a new buffer of every row, the new one too
            assert sum(a.nbytes for a in written) > held
        else:                                   # the row written into what is held
            assert sum(a.nbytes for a in written) <= held


def test_quick_run_prints_the_table_and_json(tmp_path):
    out = tmp_path / "layouts.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attention_layouts", "--scale", "16", "--repeats", "2",
         "--warmup", "1", "--heads", "4", "--head-dim", "16", "--page", "8", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "load average before" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 6 + 6 + 7 + 2 + 6   # header; A, B; C with cascade and probes; D
    data = json.loads(out.read_text())
    assert {r["case"] for r in data["results"]} == {"A", "B", "C", "D"}
    joins = [r for r in data["results"] if r["join_ms"] is not None]
    assert {r["case"] for r in joins} == {"D"} and len(joins) == 6
