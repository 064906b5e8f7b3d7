"""worker_proc/disk_io.py: spills gathered before the Step's writes and written by
the writer thread; reads that put the exact KV (and window tail, and state) into
other slots; every unusable entry a miss that leaves the prefill to compute."""

from dataclasses import replace

import mlx.core as mx
import pytest

from mlxd.protocol import DiskRun, PrefillInput, SamplingParams, Spill
from mlxd.runtime.kv_disk import KVDiskStore, entry_name
from mlxd.runtime.prefix_hash import ROOT_HASH, block_hashes
from mlxd.worker_proc.batch_cache import KV, CacheLayout
from mlxd.worker_proc.disk_io import DiskIO, array_bytes, array_of, without_disk
from mlxd.worker_proc.kv_pool import KVGeometry, KVPool

N = 32   # tokens of the test run (two blocks)


def make_pool(dtype=mx.float32, window: int = 0, states: bool = False) -> KVPool:
    layout = CacheLayout((KV, KV), (0, window)) if window else None
    shapes = (((4, 3), mx.float32),) if states else ()
    geometry = KVGeometry(2, 2, 8, 8, dtype, layout, state_shapes=(shapes,) if states else ())
    pool = KVPool(geometry, 128, state_slots=4 if states else 0,
                  window_capacity=32 if window else 0)
    for layer in range(2):
        rows = pool.keys[layer][0].shape[1]   # head-major: [heads, rows, dim]
        pool.keys[layer][0] = mx.random.normal((2, rows, 8)).astype(dtype)
        pool.values[layer][0] = mx.random.normal((2, rows, 8)).astype(dtype)
    if states:
        pool.states.arrays[0][0] = mx.random.normal(pool.states.arrays[0][0].shape)
    mx.eval(pool.arrays)
    return pool


def spill_of(tokens, slots, **extra) -> Spill:
    run = DiskRun(ROOT_HASH, block_hashes(tokens)[-1], len(tokens), extra.pop("resumable", True))
    return Spill(run, list(tokens), list(slots), **extra)


def prefill_of(spill: Spill, slots, **extra) -> PrefillInput:
    ids = list(spill.tokens) + [5]
    return PrefillInput(1, ids, [], list(slots) + [127], SamplingParams(),
                        disk_runs=[spill.run], disk_start=0, disk_tokens=len(spill.tokens),
                        **extra)


@pytest.fixture
def io_for(tmp_path):
    made = []

    def make(pool, queue_bytes=1 << 30, max_bytes=1 << 30):
        io = DiskIO(KVDiskStore(tmp_path / "kv", "f", max_bytes), pool, queue_bytes)
        made.append(io)
        return io
    yield make
    for io in made:
        io.close()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_spill_reads_back_into_other_slots_exactly(io_for, dtype):
    pool = make_pool(dtype)
    io = io_for(pool)
    tokens = list(range(100, 100 + N))
    old, new = list(range(1, N + 1)), list(range(50, 50 + N))
    spill = spill_of(tokens, old)
    io.spill([spill])
    before = [mx.array(pool.keys[0][0][:, mx.array(old)]),
              mx.array(pool.values[1][0][:, mx.array(old)])]
    for layer in range(2):   # the Step's own writes come after the gather
        pool.write_raw(layer, mx.array(old), [mx.zeros((N, 2, 8), dtype)] * 2)
    assert io.flush(10) and io.written == 1
    p = prefill_of(spill, new)
    io.start_reads([p])
    loaded = io.load(p)
    assert loaded.input_ids == [5] and loaded.prefix_slot_ids == new
    assert loaded.new_slot_ids == [127] and loaded.disk_tokens == 0
    mx.eval(pool.arrays)
    assert mx.array_equal(pool.keys[0][0][:, mx.array(new)], before[0]).item()
    assert mx.array_equal(pool.values[1][0][:, mx.array(new)], before[1]).item()
    assert io.take_news() == ([], [])


def test_bytes_round_trip_any_dtype():
    for dtype in (mx.float32, mx.float16, mx.bfloat16, mx.uint32, mx.int8):
        a = (mx.arange(24).reshape(2, 3, 4) * 3).astype(dtype)
        assert mx.array_equal(array_of(array_bytes("x", a)), a).item()
        assert array_of(array_bytes("x", a)).dtype == dtype


@pytest.mark.parametrize("damage", ["truncate", "flip", "other tokens", "gone"])
def test_an_unusable_entry_is_a_miss_and_the_prefill_computes(io_for, damage):
    pool = make_pool()
    io = io_for(pool)
    tokens = list(range(200, 200 + N))
    spill = spill_of(tokens, range(1, N + 1))
    io.spill([spill])
    assert io.flush(10)
    path = io.store.dir / entry_name(spill.run.parent, spill.run.end, N)
    data = path.read_bytes()
    p = prefill_of(spill, range(60, 60 + N))
    if damage == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "other tokens":   # the prompt differs from what the entry holds
        p = PrefillInput(1, [7] * N + [5], [], list(range(60, 60 + N)) + [127],
                         SamplingParams(), disk_runs=[spill.run], disk_tokens=N)
    else:
        path.unlink()
    loaded = io.load(p)
    assert loaded == without_disk(p) and loaded.input_ids == p.input_ids
    gone, missed = io.take_news()
    assert missed == [1]
    if damage in ("truncate", "flip"):
        assert not path.exists() and gone == [path.name]


def test_spills_past_the_queue_bound_are_skipped_and_reported_gone(io_for):
    pool = make_pool()
    io = io_for(pool, queue_bytes=pool.geometry.bytes_per_token * N)   # one spill
    io._wake.acquire()   # hold the writer so the queue fills
    try:
        first = spill_of(list(range(N)), range(1, N + 1))
        second = spill_of(list(range(1000, 1000 + N)), range(40, 40 + N))
        io.spill([first, second])
    finally:
        io._wake.release()
    assert io.flush(10)
    gone, _ = io.take_news()
    assert gone == [entry_name(second.run.parent, second.run.end, N)] and io.written == 1


def test_a_spill_of_slots_outside_the_pool_is_refused(io_for):
    io = io_for(make_pool())
    io.spill([spill_of(list(range(N)), [500] * N)])
    assert io.flush(10) and io.written == 0 and len(io.take_news()[0]) == 1


def test_window_tail_and_state_travel_with_a_resumable_run(io_for):
    pool = make_pool(window=4, states=True)
    io = io_for(pool)
    tokens = list(range(300, 300 + N))
    tail = [3, 4, 5, 6, 7]   # window slots of the 5 positions before the end
    spill = spill_of(tokens, range(1, N + 1), window_ids=tail, snapshot_slot=2)
    io.spill([spill])
    want_tail = mx.array(pool.keys[1][0][:, mx.array(tail)])
    want_state = mx.array(pool.states.arrays[0][0][2])
    assert io.flush(10) and io.written == 1
    new_windows = [0] * (N - 4) + [20, 21, 22, 23]   # the window before position N
    p = prefill_of(spill, range(60, 60 + N), new_window_ids=new_windows + [24],
                   disk_state_slot=3)
    loaded = io.load(p)
    mx.eval(pool.arrays)
    assert loaded.state_from == 3 and loaded.prefix_window_ids == new_windows
    assert mx.array_equal(pool.keys[1][0][:, mx.array([20, 21, 22, 23])],
                          want_tail[:, 1:]).item()
    assert mx.array_equal(pool.states.arrays[0][0][3], want_state).item()
    bad = prefill_of(spill, range(60, 60 + N), new_window_ids=[0] * (N - 6) + [1] * 6 + [2],
                     disk_state_slot=3)   # a window position the tail lacks
    assert io.load(bad) == without_disk(bad)


@pytest.mark.parametrize("fields,match", [
    ({"disk_tokens": N}, "disk_tokens needs disk_runs"),                      # no runs
    ({"disk_tokens": N + 1}, "disk_tokens needs disk_runs"),                  # nothing computed
    ({"disk_tokens": N, "disk_start": 5}, "disk_tokens needs disk_runs"),     # starts past the prefix
    ({"disk_state_slot": 2}, "state slots for a model without state"),
])
def test_the_worker_refuses_disk_fields_that_do_not_fit(fields, match):
    from mlxd.worker_proc.step_checks import check_prefills

    spill = spill_of(list(range(N)), range(1, N + 1))
    p = prefill_of(spill, range(60, 60 + N))
    runs = [] if fields == {"disk_tokens": N} else [spill.run]
    bad = replace(p, **{"disk_runs": runs, "disk_tokens": 0, **fields})
    with pytest.raises(ValueError, match=match):
        check_prefills([bad], [], make_pool(), 1000)
