"""A ragged decode batch against mlx_lm: 3000-token rows beside 16-token rows, rows
joining and leaving every step, a long prompt prefilled in chunks, a second long row
starting from the first one's cached prefix (its full pages shared), and that row
retracted and resumed from its KV in the pool; overlap on and off, both layouts.
Every row's tokens and chosen-token logprobs must be mlx_lm's own generation's."""

import random

import pytest

from mlxd.protocol import PrefillInput, SamplingParams
from support import reference_tokens
from test_model_runner import Driver

LONG, SHORT, CHUNK, SHARED = 3000, 16, 1024, 2000
SHORT_TOKENS = 4   # each short row leaves after this many tokens


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(path: str, overlap: bool, layout: str):
    d = Driver(path, capacity=16384, overlap=overlap, decode_layout=layout)
    a = prompt(1, LONG)
    b = a[:SHARED] + prompt(2, LONG - SHARED)
    prompts = {1: a, 2: b}
    # the long row 1 in chunks, then row 2 from row 1's cached prefix
    d.step([d.prefill(1, a[:CHUNK], needs_logits=False)])
    d.step([d.prefill(1, a[CHUNK:2 * CHUNK], d.slot_ids[1][:CHUNK], needs_logits=False)])
    d.step([d.prefill(1, a[2 * CHUNK:], d.slot_ids[1][:2 * CHUNK])])
    short_rid, born = 100, {}
    for step in range(24):
        joins, releases = [], [r for r, at in born.items()
                               if r in d.running and len(d.out.get(r, ())) >= SHORT_TOKENS]
        if step == 2:
            joins.append(d.prefill(2, b[SHARED:], d.slot_ids[1][:SHARED]))
        if step == 9:   # row 2 retracted: released, then resumed from its KV in the pool
            releases.append(2)
        if step == 10:
            held = d.slot_ids[1][:SHARED] + d.slot_ids[2]
            last = d.out[2][-1][0]
            joins.append(PrefillInput(2, [last], held, d.new_slots(2, 1, len(held)), SamplingParams(),
                                      num_generated=len(d.out[2])))
        prompts[short_rid] = prompt(short_rid, SHORT)
        joins.append(d.prefill(short_rid, prompts[short_rid]))
        born[short_rid] = step
        short_rid += 1
        d.step(joins, releases)
        if step in (2, 10) and layout == "paged":   # row 2 holds row 1's prefix pages
            tables = dict(zip(d.runner.batch.rids, d.runner.batch.tables))
            full = SHARED // d.runner.decode_page
            assert tables[2][:full] == tables[1][:full]
    return d, prompts


@pytest.mark.parametrize("layout", ["paged", "padded"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_long_and_short_rows_joining_and_leaving_decode_as_mlx_lm(llama_model, overlap,
                                                                  layout):
    d, prompts = run(llama_model, overlap, layout)
    assert len(d.out[2]) > 12 and len(d.out[1]) > 20   # both long rows decoded on and on
    for rid, ids in prompts.items():
        got = d.out.get(rid, [])
        if not got:
            continue
        ref = reference_tokens(llama_model, ids, len(got), ignore_eos=True)
        assert [t for t, _ in got] == [t for t, _ in ref], rid
        assert max(abs(x[1] - y[1]) for x, y in zip(got, ref)) < 1e-3, rid
