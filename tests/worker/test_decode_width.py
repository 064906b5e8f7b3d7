"""The padded layout's decode caches never span more than the shared rule
(runtime/kv_layout.py) says, the rule the scheduler budgets `decode_cache_tokens`
with: if the two sides disagree, the scheduler under-budgets memory without a sign.
In pages the rows read the pool in place and nothing is copied anywhere else: a
window where a cached prefix ends inside a page is completed in the pool, in the
page the row took for it.

The ModelRunner runs real Steps on a stand-in model that writes random KV into the
caches it is handed, so widths of hundreds of positions cost nothing."""

import itertools
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxd.protocol import PrefillInput, SamplingParams, Step
from mlxd.runtime.kv_layout import DECODE_PAGE, batch_tokens, decode_cache_budget, row_width
from mlxd.scheduler_proc.allocator import SlotAllocator
from mlxd.scheduler_proc.scheduler import Scheduler, SchedulerLimits
from mlxd.worker_proc.kv_pool import KVGeometry, KVPool
from mlxd.worker_proc.decode_pages import scaled_dot_product_attention
from mlxd.worker_proc.memory import ACTIVATION_RESERVE_BYTES, kv_budget
from mlxd.worker_proc.model_runner import runner_for
from support import decode_rows

GEOMETRY = KVGeometry(num_layers=2, n_kv_heads=2, k_head_dim=4, v_head_dim=4,
                      dtype=mx.float32)
CAPACITY = 8192
VOCAB = 16


class KVWriter:
    """Stands in for a model: writes random keys/values for its input positions into
    every layer's cache, attends through the hooked attention, and returns zero
    logits (greedy sampling picks token 0)."""

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        b, t = tokens.shape
        g = GEOMETRY
        for c in cache or []:
            k, v = c.update_and_fetch(mx.random.normal((b, g.n_kv_heads, t, g.k_head_dim)),
                                      mx.random.normal((b, g.n_kv_heads, t, g.v_head_dim)))
            scaled_dot_product_attention(mx.zeros((b, g.n_kv_heads, t, g.k_head_dim)), k, v,
                                         cache=c, scale=1.0, mask=None)
        return mx.zeros((b, t, VOCAB))


class Driver:
    """Plays the scheduler: counts each row's KV positions as the scheduler does (the
    slots it holds) and checks the worker's caches against the rule after each Step."""

    def __init__(self, overlap: bool, layout: str = "padded"):
        page = DECODE_PAGE if layout == "paged" else 1
        self.runner = runner_for(KVWriter(), KVPool(GEOMETRY, CAPACITY, page=page),
                                 overlap=overlap, decode_layout=layout)
        self.page = self.runner.decode_page
        assert (self.page > 0) == (layout == "paged")
        self.slots = itertools.cycle(range(1, CAPACITY + 1))   # padded: any slots do
        self.alloc = SlotAllocator(10 * CAPACITY, page)   # pages: as the scheduler books
        self.ends: dict[int, int] = {}    # rid -> its next position's slot's page (pages)
        self.prefills: list[PrefillInput] = []
        self.step_ids = itertools.count(1)
        self.lengths: dict[int, int] = {}   # rid -> KV positions (its slots)
        self.running: list[int] = []
        self.dead: list[int] = []   # released rows' lengths, while the caches hold them
        self.spans: list[tuple[int, int]] = []   # (worker's span, the rule's) per step

    def step(self, joins: dict[int, tuple[int, int]] | None = None,
             releases: tuple = ()) -> None:
        """`joins`: rid -> (new tokens, cached prefix tokens)."""
        joins = joins or {}
        self.dead += [self.lengths[rid] for rid in releases]
        self.running = [rid for rid in self.running if rid not in releases]
        decode_slots = [self._slot(rid) for rid in self.running]
        for rid in self.running:
            self.lengths[rid] += 1
        chain_pages = [self._book_next(rid) for rid in self.running] if self.page else []
        prefills = [self._prefill(rid, new, prefix) for rid, (new, prefix) in joins.items()]
        self.prefills += prefills
        self.runner.run(Step(next(self.step_ids),
                             decode_rows(self.running, decode_slots, chain_pages=chain_pages),
                             prefills, list(releases)))
        self.running += list(joins)
        self.runner.close()   # the chained decode, if any, has written its position
        self._check(joined=bool(joins))

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def _slot(self, rid: int) -> int:
        """The slot of the row's next position (pages: in the page it took for it)."""
        if not self.page:
            return next(self.slots)
        n = self.lengths[rid]
        slot = self.alloc.extend(n, 1, self.ends.get(rid, 0))[0]
        self.ends[rid] = slot // self.page
        return slot

    def _book_next(self, rid: int) -> int:
        """The page a chained decode writes the row's next position in, where that
        position starts one (the scheduler's chain_pages)."""
        n = self.lengths[rid]
        if n % self.page:
            return 0
        self.ends[rid] = self.alloc.take_page(n // self.page)
        return self.ends[rid]

    def _prefill(self, rid: int, new: int, prefix: int) -> PrefillInput:
        """A prefix of `prefix` positions cached by another sequence (pages: its own
        pages, so a prefix ending inside one is a window the row copies)."""
        self.lengths[rid] = new + prefix
        if not self.page:
            return PrefillInput(rid, [1] * new, [next(self.slots) for _ in range(prefix)],
                                [next(self.slots) for _ in range(new)], SamplingParams())
        cached = self.alloc.allocate(prefix)
        fresh = self.alloc.extend(prefix, new, 0)
        self.ends[rid] = fresh[-1] // self.page
        return PrefillInput(rid, [1] * new, cached, fresh, SamplingParams())

    def _check(self, joined: bool) -> None:
        batch = self.runner.batch
        assert sorted(batch.rids) == sorted(self.running)
        if self.page:   # the rows read the pool in place: every window a pool page
            batch.check_integrity()
            assert all(e > 0 for t in batch.tables for e in t)
            ahead = 1 if self.runner.overlap else 0   # the chained decode's position
            assert batch.lengths == [self.lengths[rid] + ahead for rid in batch.rids]
            return
        if None not in batch.row_rids:   # a join or a compaction dropped the dead rows
            self.dead = []
        rule = batch_tokens([self.lengths[rid] for rid in batch.rids] + self.dead)
        self.spans.append((batch.cache_tokens, rule))
        assert batch.cache_tokens <= rule, (
            f"the decode caches span {batch.cache_tokens} tokens, the rule budgets {rule} "
            f"(rows {[self.lengths[r] for r in batch.rids]}, dead {self.dead})")
        if joined:
            assert batch.cache_tokens == rule, "a join lays the rows out as the rule says"


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
LAYOUTS = pytest.mark.parametrize("layout", ["paged", "padded"])


@LAYOUTS
@OVERLAP
def test_rows_of_various_lengths_join_and_decode_across_steps(overlap, layout):
    d = Driver(overlap, layout)
    d.step({1: (250, 0), 2: (3, 0)})
    d.decode(8)   # rid 1 crosses 254 -> 255 positions: the rule's width steps to 512
    d.step({3: (40, 0), 4: (41, 0)})
    d.decode(3)
    d.step({5: (500, 0)})
    d.decode(15)   # rid 5 passes 510, 512 and 514 positions
    d.step({6: (7, 0)})
    d.decode(2)
    if layout == "padded":   # decodes between joins count too
        assert any(span != rule for span, rule in d.spans)


@LAYOUTS
@OVERLAP
def test_joins_with_cached_prefixes_of_different_lengths(overlap, layout):
    d = Driver(overlap, layout)
    d.step({1: (20, 0)})
    d.step({2: (6, 240), 3: (6, 100), 4: (6, 10)})   # one left-padded prefill group
    d.decode(12)
    d.step({5: (2, 700), 6: (300, 0)})
    d.decode(4)


@OVERLAP
def test_a_prefix_ending_mid_page_is_copied_into_the_rows_own_page(overlap):
    """The window where a cached prefix ends inside a page: the prefix's positions are
    copied (in the pool) into the page the row took for that window, before its
    first position there; the row reads that page like any other, and the copies
    hold the prefix's KV as stored."""
    d = Driver(overlap, "paged")
    d.step({rid: (30 + rid, 100 + rid) for rid in range(6)})   # prefixes end mid-page
    d.decode(2)
    batch, pool = d.runner.batch, d.runner.pool
    assert all(e > 0 for t in batch.tables for e in t)
    prefill = d.prefills[0]   # rid 0: 100 prefix positions, 30 new
    window = 100 // DECODE_PAGE
    own = prefill.new_slot_ids[0] // DECODE_PAGE
    assert batch.tables[0][window] == own
    src = mx.array(prefill.prefix_slot_ids[window * DECODE_PAGE:], mx.int32)
    dst = mx.array([own * DECODE_PAGE + i for i in range(100 % DECODE_PAGE)], mx.int32)
    for layer in range(GEOMETRY.num_layers):
        for a, b in zip(pool.read_raw(layer, src), pool.read_raw(layer, dst)):
            assert mx.array_equal(a, b).item()
    d.step(releases=(0, 3))
    d.step({7: (200, 0), 8: (3, 70)}, releases=(1,))
    d.decode(3)


@OVERLAP
def test_rows_without_a_mid_page_prefix_copy_nothing(overlap):
    """Fresh prompts and prefixes of whole pages: every window of every row is one
    pool page, read in place."""
    d = Driver(overlap, "paged")
    d.step({1: (300, 0), 2: (5, 2 * DECODE_PAGE), 3: (70, 0)})
    d.decode(70)   # rows cross page boundaries, chained or not
    assert all(e > 0 for t in d.runner.batch.tables for e in t)


@OVERLAP
def test_decode_with_dead_rows_stays_within_what_the_scheduler_last_counted(overlap):
    """A released row stays in the caches (dead) until a join or a compaction; the
    caches must not outgrow what the scheduler counted with that row still running."""
    d = Driver(overlap, "padded")
    d.step({rid: (250 if rid == 0 else 20 + rid, 0) for rid in range(10)})
    d.decode(2)
    d.step(releases=(0,))   # the longest row: 1 of 10 dead, kept
    assert d.runner.batch.row_rids.count(None) == 1
    d.decode(8)   # the dead row would have crossed 254 positions
    d.step(releases=(1, 2))   # a compaction
    d.decode(3)
    d.step({20: (3, 0)}, releases=(3,))
    d.decode(2)


@OVERLAP
def test_a_compaction_lays_the_rows_out_as_the_rule_says(overlap):
    """Dropping the longest rows must not leave a buffer that later grows past what
    the scheduler counts for the rows left."""
    d = Driver(overlap, "padded")
    d.step({rid: (500 if rid < 2 else 255, 0) for rid in range(9)})
    d.step(releases=(0, 1))   # 2 of 9 dead: compacted
    assert None not in d.runner.batch.row_rids
    assert d.spans[-1][0] == d.spans[-1][1]
    d.decode(16)


def test_the_scheduler_budgets_with_the_shared_rule():
    """The scheduler's width check admits rows exactly up to kv_layout's rule, and its
    default budget is the rule's."""
    lengths = [40, 300, 254]
    limits = SchedulerLimits(kv_capacity=4096, max_context=4096,
                             decode_cache_tokens=batch_tokens(lengths))
    rows = [SimpleNamespace(slot_ids=[0] * n) for n in lengths[:2]]
    assert Scheduler(limits)._width_fits(rows, lengths[2])
    tight = SchedulerLimits(kv_capacity=4096, max_context=4096,
                            decode_cache_tokens=batch_tokens(lengths) - 1)
    assert not Scheduler(tight)._width_fits(rows, lengths[2])
    default = Scheduler(SchedulerLimits(kv_capacity=1000, max_context=4096,
                                        max_running_requests=3))
    assert default.decode_cache_tokens == decode_cache_budget(1000, 3) == row_width(999)


def test_in_pages_the_scheduler_checks_no_decode_width():
    """In pages a running row's KV is the pool's: no second budget to fit."""
    limits = SchedulerLimits(kv_capacity=4096, max_context=4096, decode_page=DECODE_PAGE,
                             decode_cache_tokens=1)
    rows = [SimpleNamespace(slot_ids=[0] * n) for n in (40, 3000)]
    assert Scheduler(limits)._width_fits(rows, 1000)


@pytest.mark.parametrize("tokens", [40_000, 100_000, 1_000_000])
@pytest.mark.parametrize("max_running", [1, 16, 64])
def test_the_worker_memory_split_uses_the_shared_budget(tokens, max_running):
    """Padded: memory.kv_budget reports the scheduler's budget for its pool, and the
    pool plus twice that budget (a join copies) fits the memory it split. Pages: one
    KV term, the pool in whole pages."""
    budget = kv_budget(tokens * 100 + ACTIVATION_RESERVE_BYTES, 0, 100,
                       max_running=max_running, ceiling=10**9, page=0)
    assert budget.decode_cache_tokens == decode_cache_budget(budget.capacity, max_running)
    assert budget.capacity + 2 * budget.decode_cache_tokens <= tokens
    fixed = kv_budget(0, 0, 100, max_running=max_running, ceiling=10**9, capacity=3000)
    assert fixed.decode_cache_tokens == decode_cache_budget(3000, max_running)
    paged = kv_budget(tokens * 100 + ACTIVATION_RESERVE_BYTES, 0, 100,
                      max_running=max_running, ceiling=10**9, page=DECODE_PAGE)
    assert paged.decode_cache_tokens == 0 and paged.capacity % DECODE_PAGE == 0
    assert tokens - DECODE_PAGE < paged.capacity <= tokens


@OVERLAP
def test_a_decode_that_would_grow_the_caches_drops_the_dead_rows_first(llama_model, overlap):
    """With a dead row in a batch whose longest row reaches the buffer's end, the
    decode compacts instead of growing a buffer the scheduler no longer counts; every
    live row's tokens and pool KV stay mlx_lm's."""
    from test_model_runner import Driver as ModelDriver
    from test_model_runner import assert_matches_reference, assert_pool_holds_mlx_lm_kv

    d = ModelDriver(llama_model, decode_layout="padded")
    d.runner.overlap = overlap
    ids = [[(7 * i + r) % 500 + 3 for i in range(240 if r == 0 else 20 + r)]
           for r in range(9)]
    d.step([d.prefill(r, ids[r]) for r in range(9)])
    d.step(releases=[4])   # 1 of 9 dead: kept
    d.runner.close()
    caches_before = d.runner.batch.caches
    assert d.runner.batch.row_rids.count(None) == 1
    for _ in range(19):   # rid 0 passes 256 positions
        d.step()
    d.runner.close()
    assert None not in d.runner.batch.row_rids and d.runner.batch.caches is not caches_before
    for rid in (0, 3, 5, 8):
        assert_matches_reference(llama_model, ids[rid], d.out[rid])
        assert_pool_holds_mlx_lm_kv(d, rid, ids[rid])
