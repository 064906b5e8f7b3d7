"""The window pool: sliding-window layers' KV stored at scheduler-booked window ids,
held only for the last W positions of what a request computed. ModelRunner against
mlx_lm on the windowed test models, with window ids booked the way the scheduler
books them; the pool's shapes; the checks that refuse bad window ids."""

import mlx.core as mx
import pytest

import test_hybrid_runner
from mlxd.protocol import DecodeRow, PrefillInput, Step
from mlxd.worker_proc.kv_pool import KVPool
from mlxd.worker_proc.model_runner import probe_geometry
from support import PROMPTS, encode, load_reference
from test_hybrid_runner import LONG, WINDOWED, assert_matches, run_two_chunked

WINDOW_CAPACITY = 96   # 9 rows x (W + 1) at most: ids are reused all the time


class Driver(test_hybrid_runner.Driver):
    """Books window ids as the scheduler does: a position holds one only while it is
    among the last W positions its request computed (a piece's older new tokens get
    0, and after each step everything older is freed); freed ids are handed out again
    first, so a stale id would show up as wrong tokens; prefix positions older than
    W are sent as 0."""

    def __init__(self, model_path: str, overlap: bool = False,
                 window_capacity: int = WINDOW_CAPACITY):
        super().__init__(model_path, overlap, state_slots=0, window_capacity=window_capacity)
        self.path = model_path
        self.sent: list[PrefillInput] = []
        self.window = self.runner.pool.window
        assert self.window > 0
        self.free_windows = list(range(window_capacity, 0, -1))
        self.window_of: dict[int, int] = {}   # slot id -> the window id its position holds

    def new_slots(self, rid: int, n: int, start: int | None = None) -> list[int]:
        slots = super().new_slots(rid, n, start)
        for slot in slots[-self.window:]:
            self.window_of[slot] = self.free_windows.pop()
        return slots

    def window_ids(self, slots: list[int]) -> list[int]:
        return [self.window_of.get(s, 0) for s in slots]

    def prefill(self, rid, ids, prefix=(), needs_logits=True, state_from=0, state_slot=0):
        p = super().prefill(rid, ids, prefix, needs_logits)
        p.prefix_window_ids = self.window_ids(p.prefix_slot_ids)
        p.new_window_ids = self.window_ids(p.new_slot_ids)
        self.sent.append(p)
        return p

    def step(self, prefills=(), releases=()):
        result = super().step(prefills, releases)
        self.free_beyond_windows()
        return result

    def free_beyond_windows(self) -> None:
        """Every request keeps window ids for its last W computed positions only."""
        for slots in self.slot_ids.values():
            for slot in slots[:-self.window]:
                held = self.window_of.pop(slot, 0)
                if held:
                    self.free_windows.append(held)

    def finish(self, n: int = test_hybrid_runner.MAX_TOKENS) -> None:
        super().finish(n)
        assert len(self.window_of) <= self.window * len(self.slot_ids)
        assert_row_zero_is_zeros(self.runner.pool)


def assert_row_zero_is_zeros(pool: KVPool) -> None:
    """Window id 0 is never written: it reads zeros for positions beyond the window."""
    windowed = [layer for layer in range(len(pool.keys)) if pool.windowed(layer)]
    assert windowed
    for layer in windowed:
        assert not mx.any(pool.keys[layer][0][:, 0]).item()
        assert not mx.any(pool.values[layer][0][:, 0]).item()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
@pytest.mark.parametrize("arch", WINDOWED)
def test_staggered_batch_matches_mlx_lm(arch, overlap, hybrid_model):
    path = hybrid_model(arch)
    d = Driver(path, overlap)
    ids = [encode(path, p) for p in PROMPTS] + [encode(path, LONG)]
    for step in range(4):   # rows join a running batch, prompts longer than the window
        d.step([d.prefill(r, ids[r]) for r in range(len(ids)) if r % 4 == step])
    d.finish()
    for r in range(len(ids)):
        assert_matches(path, ids[r], d.out[r])


@pytest.mark.parametrize("size", [3, 5, 11])
@pytest.mark.parametrize("arch", WINDOWED)
def test_chunks_splitting_the_window_read_it_from_the_pool(arch, size, hybrid_model):
    """Each chunk's prefix is everything before it, of which only the last W
    positions hold window ids."""
    d = run_two_chunked(hybrid_model(arch), Driver, size)
    assert any(0 in p.prefix_window_ids for p in d.sent)   # beyond the window: not held


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
@pytest.mark.parametrize("arch", WINDOWED)
def test_prefixes_read_from_the_pool_hold_only_their_windows(arch, overlap, hybrid_model):
    """Two prefixes (30 and 20 tokens) fill the pool and keep window ids for their
    last W positions only; rows extending them run as one left-padded group beside a
    plain row, and later alone while others decode."""
    path = hybrid_model(arch)
    d = Driver(path, overlap)
    base = encode(path, LONG)
    d.step([d.prefill(0, base[:30], needs_logits=False),
            d.prefill(5, base[:20], needs_logits=False)])
    assert d.window_ids(d.slot_ids[0])[:30 - d.window] == [0] * (30 - d.window)
    tails = {1: base[30:40], 2: base[20:30], 4: encode(path, PROMPTS[1])[1:]}
    d.step([d.prefill(1, tails[1], d.slot_ids[0]), d.prefill(2, tails[2], d.slot_ids[5]),
            d.prefill(3, encode(path, PROMPTS[2]))])
    d.step([d.prefill(4, tails[4], d.slot_ids[0])])
    d.finish()
    assert_matches(path, base[:30] + tails[1], d.out[1])
    assert_matches(path, base[:20] + tails[2], d.out[2])
    assert_matches(path, base[:30] + tails[4], d.out[4])
    assert_matches(path, encode(path, PROMPTS[2]), d.out[3])


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
@pytest.mark.parametrize("arch", WINDOWED)
def test_a_prefix_ending_in_decoded_tokens_matches_mlx_lm(arch, overlap, hybrid_model):
    """A finished request's prompt and output are the prefix of the next (as after a
    retraction): its last W positions' window KV was written by decode steps, one of
    them beside a released row."""
    path = hybrid_model(arch)
    d = Driver(path, overlap)
    ids = {0: encode(path, LONG), 1: encode(path, PROMPTS[3])}
    d.step([d.prefill(0, ids[0]), d.prefill(1, ids[1])])
    for _ in range(4):
        d.step()
    d.step(releases=[1])
    for _ in range(6):
        d.step()
    d.step(releases=[0])
    d.runner.close()
    output = [t for t, _ in d.out[0]]
    prefix = d.slot_ids[0]   # prompt and output but the last token (no KV yet)
    assert len(prefix) == len(ids[0]) + len(output) - 1
    d.step([d.prefill(2, output[-1:], prefix)])
    d.finish()
    assert_matches(path, ids[0] + output, d.out[2])


# ---- the pool ---------------------------------------------------------------

def test_windowed_layers_get_the_window_pools_rows(hybrid_model, llama_model):
    gemma, _ = load_reference(hybrid_model("gemma3_text"))
    geometry = probe_geometry(gemma)
    windows = geometry.cache_layout.windows
    assert 0 in windows and 8 in windows   # a global and a windowed layer
    pool = KVPool(geometry, 100, window_capacity=24)
    assert pool.uses_windows and pool.window == 8
    for layer, w in enumerate(windows):
        assert pool.windowed(layer) is (w > 0)
        assert pool.keys[layer][0].shape[1] == pool.values[layer][0].shape[1] == (25 if w else 101)
    assert geometry.bytes_per_window_token * 2 == geometry.bytes_per_token
    plain = KVPool(geometry, 100)
    assert not plain.uses_windows and all(k[0].shape[1] == 101 for k in plain.keys)
    llama, _ = load_reference(llama_model)   # no windowed layer: no window pool
    assert not KVPool(probe_geometry(llama), 100, window_capacity=24).uses_windows


# ---- what the runner refuses ------------------------------------------------

@pytest.fixture
def gemma_driver(hybrid_model):
    return Driver(hybrid_model("gemma3_text"), window_capacity=32)


def run_prefill(d: Driver, p: PrefillInput) -> None:
    d.runner.run(Step(1000 + p.rid, prefills=[p]))


def test_window_ids_outside_the_window_pool_are_refused(gemma_driver):
    d = gemma_driver
    p = d.prefill(1, [1, 2, 3])
    p.new_window_ids[1] = 33
    with pytest.raises(ValueError, match="window id outside 0..32"):
        run_prefill(d, p)


def test_window_ids_must_pair_with_the_slot_ids(gemma_driver):
    d = gemma_driver
    d.step([d.prefill(0, [1, 2, 3, 4], needs_logits=False)])
    short = d.prefill(1, [5, 6])
    short.new_window_ids = short.new_window_ids[:1]
    missing = d.prefill(2, [5, 6], d.slot_ids[0])
    missing.prefix_window_ids = []
    for p in (short, missing):
        with pytest.raises(ValueError, match="one for one"):
            run_prefill(d, p)


def test_a_prefix_without_its_window_kv_is_refused(gemma_driver):
    d = gemma_driver
    ids = encode(d.path, LONG)
    d.step([d.prefill(0, ids[:20], needs_logits=False),
            d.prefill(1, ids[:4], needs_logits=False)])
    p = d.prefill(2, ids[20:22], d.slot_ids[0])
    p.prefix_window_ids[-3] = 0   # within the last W positions
    short = d.prefill(3, ids[4:6], d.slot_ids[1])   # shorter than W: all must be held
    short.prefix_window_ids[0] = 0
    for bad in (p, short):
        with pytest.raises(ValueError, match="a prefix without its window KV"):
            run_prefill(d, bad)


def test_decode_window_ids_are_checked(gemma_driver):
    d = gemma_driver
    for rid, window, match in ((0, 0, "a window id per decoded request"),
                               (1, 40, "window id outside")):
        d.running = []
        d.step([d.prefill(rid, [1, 2, 3])])
        with pytest.raises(ValueError, match=match):
            d.runner.run(Step(500 + rid, [DecodeRow(rid, d.new_slots(rid, 1)[0], window)]))
        d.runner.reset()   # as the worker does after a failed step


def test_window_ids_sent_without_a_window_pool_are_refused(hybrid_model, llama_model):
    for path in (llama_model, hybrid_model("gemma3_text")):
        d = test_hybrid_runner.Driver(path)   # window_capacity 0
        assert not d.runner.pool.uses_windows
        p = d.prefill(1, [1, 2, 3])
        p.new_window_ids = [1, 2, 3]
        with pytest.raises(ValueError, match="without a window pool"):
            run_prefill(d, p)
        d.step([d.prefill(2, [1, 2, 3])])
        with pytest.raises(ValueError, match="without a window pool"):
            d.runner.run(Step(77, [DecodeRow(2, d.new_slots(2, 1)[0], window=1)]))
