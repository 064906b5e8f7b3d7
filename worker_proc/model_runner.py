"""ModelRunner: executes Steps on the model. MLX only; no sockets.

The scheduler's slot ids are the only way KV reaches the pool: prefill KV is
written at `new_slot_ids`, each decode step's input-token KV at its row's
`DecodeRow.slot` (with a window pool, the windowed layers' at `new_window_ids`
and `DecodeRow.window`). The runner never derives a slot id on its own.
"""

import copy
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import mlx.core as mx

from mlxd.protocol import DecodeRow, PrefillInput, Step, StepResult, StepTiming

from . import batch_cache, thinking
from .background import BackgroundJob
from .decode import DecodeRows, JoinGroup, UnsupportedModel, decode_page_for, decode_rows
from .paged_batch import SlotMismatch
from .disk_io import DiskIO, without_disk
from .draft_model import DraftModel, rejection_runs
from .grammar import Grammars, RowGrammar, allowed
from .kv_pool import KVGeometry, KVPool, write_ids
from .penalties import RowPenalties
from .prefill import GroupPrefill, plan_groups
from .sampling import RowState, Sampled, sample, top_lists
from .step_checks import check_decode, check_drafts, check_prefills
from .thinking import ThinkBudget

CLOSE_TIMEOUT = 60.0   # s; a chained decode is one step of the batch


def probe_geometry(model) -> KVGeometry:
    """Run one token through the model to learn its cache layout, KV shapes, state
    shapes and dtype."""
    try:
        layout = batch_cache.describe(model)
    except batch_cache.UnsupportedCache as exc:
        raise UnsupportedModel(f"mlxd cannot serve this model: its caches include {exc} "
                               "(served: KV, sliding-window KV without keep, recurrent "
                               "state, lists of those)") from None
    kv, states = batch_cache.one_token_caches(model)
    shapes = tuple(tuple((tuple(a.shape[1:]), a.dtype) for a in arrays) for arrays in states)
    if len({(k.shape[1], k.shape[3], v.shape[3], k.dtype) for k, v in kv}) > 1:
        raise UnsupportedModel("mlxd cannot serve this model: its attention layers' KV "
                               "shapes differ")
    if kv:
        k, v = kv[0]
        dims = (k.shape[1], k.shape[3], v.shape[3], k.dtype)
    else:   # recurrent layers only: the pool books tokens but stores no KV
        dims = (0, 0, 0, states[0][0].dtype)
    return KVGeometry(len(kv), *dims, layout=None if layout.plain else layout,
                      state_shapes=shapes)


def probe_vocab_size(model) -> int:
    logits = model(mx.array([[0]]))
    return logits.shape[-1]


@dataclass
class _Output:
    rids: list[int | None]   # per row; None: a dead decode row
    rows: list[RowState]     # per token (a row's run repeats it)
    sampled: Sampled         # per token
    new_kv: list[tuple[mx.array, mx.array]] | None = None   # decode: per layer, the input's KV
    runs: list[int] | None = None   # a verify: tokens per row (None: one each)
    # decode: per row, the pool slot the forward wrote its input's KV at (0: not in
    # the pool yet; the commit writes it at the Step's slot)
    direct: list[int] | None = None


@dataclass
class ChainedDecode:
    """The next decode of the batch, started before its Step arrives (overlap) and
    handed from one step to the next: built at the end of a step when no row needs
    that step's token to build it (`output`), else built on the helper thread."""

    output: _Output | None = None


def runner_for(model, pool: KVPool, decode_layout: str = "auto", float_tail: int = 0,
               tail_slack: int = 8, **options) -> "ModelRunner":
    """A ModelRunner for `model`, its decode layout chosen (`decode_page_for`) and the
    model probed here, once. `float_tail`: quantized pages' (decode_rows); `options`:
    ModelRunner's."""
    page = decode_page_for(model, pool.geometry, decode_layout)
    batch = decode_rows(pool.geometry, page, pool, float_tail=float_tail,
                        tail_slack=tail_slack)
    return ModelRunner(model, pool, batch, probe_vocab_size(model), **options)


class ModelRunner:
    """Runs Steps. With `overlap`, every step the Step allows ends by starting the
    next decode of the whole batch on a helper thread, chained on this step's tokens
    (`chained`, a ChainedDecode); it computes while the result travels to the
    scheduler and the next Step comes back. That Step then commits the work for the
    rows it keeps.

    Per-step timing (ms): `wait_ms` from the previous result to this Step,
    `idle_ms` the part of it with no work in flight, `chained_wait_ms` spent
    finishing the chained decode after the Step arrived, `compute_ms` from the
    Step's arrival to its result."""

    def __init__(self, model, pool: KVPool, batch: DecodeRows, vocab_size: int,
                 prefill_step_size: int = 2048, rng: random.Random | None = None,
                 overlap: bool = False, grammars: Grammars | None = None,
                 drafter: DraftModel | None = None):
        """`batch`: the decode layout chosen at startup (decode.decode_rows);
        `vocab_size`: the model's logits' width (probe_vocab_size); `drafter`: a
        draft model (--speculative draft), in pages beside the model."""
        self.model = model
        self.grammars = grammars   # None: constrained requests are refused
        self.drafter = drafter
        self.pool = pool
        self.prefill_step_size = prefill_step_size
        self.overlap = overlap
        self.batch = batch
        self.chained: ChainedDecode | None = None   # started for the next Step
        self.vocab_size = vocab_size
        self._rng = rng or random.Random()
        # Both threads put their work on this one stream; they never use it at once.
        self.stream = mx.new_thread_unsafe_stream(mx.default_device())
        self._background = BackgroundJob()
        self._returned_at: float | None = None   # when the last result was handed back
        self._outputs_at = 0.0   # when the last step's outputs were evaluated
        self._new_grammars: dict[int, RowGrammar] = {}   # the step's prefills' (checked)
        self.disk: DiskIO | None = None   # the disk tier (--kv-disk), set after start

    @property
    def decode_page(self) -> int:
        """Positions per decode page; 0: the padded layout (kv_layout's rule)."""
        return self.batch.page

    # ---- the step ---------------------------------------------------------

    def run(self, step: Step, arrived_at: float | None = None) -> StepResult:
        """Execute `step` (received at `arrived_at`, a perf_counter() time)."""
        start = time.perf_counter()
        arrived_at = start if arrived_at is None else arrived_at
        chained, self.chained = self.chained, None
        busy_until = self._background.wait() if chained else 0.0
        timing = StepTiming(chained=chained is not None)
        timing.wait_ms, timing.idle_ms = self._wait_timing(arrived_at, busy_until)
        with mx.stream(self.stream):
            result, self.chained = self._execute(step, chained.output if chained else None)
            timing.active_memory = mx.get_active_memory()
            timing.peak_memory = mx.get_peak_memory()
        timing.chained_wait_ms = (self._outputs_at - start) * 1e3 if chained else 0.0
        if self.chained is not None:   # step k+1, chained on step k
            next_decode = self.chained
            self._background.start(lambda: self._dispatch_chained(next_decode))
        # A wait for the next Step is a round trip only while requests run.
        self._returned_at = time.perf_counter() if len(self.batch) else None
        timing.compute_ms = (time.perf_counter() - arrived_at) * 1e3
        result.timing = timing
        if self.disk is not None:
            result.disk_gone, result.disk_missed = self.disk.take_news()
        return result

    def _execute(self, step: Step, chained: _Output | None
                 ) -> tuple[StepResult, ChainedDecode | None]:
        """The step's result (`chained`: the decode started for it, if any), and the
        next decode when this step chains one (already built when it could be built
        while the step's last tasks computed)."""
        self.batch.remove(set(step.releases))
        if self.drafter is not None:
            self.drafter.remove(set(step.releases))
        if self.disk is not None:   # before any pool write of this Step
            self.disk.spill(step.spills)
            self.disk.start_reads(step.prefills)
        outputs = []
        if step.has_drafts:
            outputs.append(self._verify(step, chained))
        elif step.decodes:   # the chained decode if there is one; its released rows drop
            launched = chained or self._launch_decode(self._step_slots(step))
            outputs.append(self._commit_decode(launched, step))
        elif len(self.batch):
            raise ValueError(f"step {step.step_id} decodes nothing but "
                             f"{len(self.batch)} requests are running")
        # decided before anything moves the rows on
        if outputs and not step.prefills and self._chains(step) and self._builds_ahead:
            following = self._launch_decode()
            return self._finalize(step.step_id, outputs, writes=False), ChainedDecode(following)
        if outputs and step.prefills:
            self.batch.before_joins(_arrays(outputs) + self._draft_arrays())
        outputs += self._prefill(step.prefills)
        # the chained decode, when there is one, completes the pool writes
        chains = self._chains(step)   # the joined rows included
        result = self._finalize(step.step_id, outputs, pool_writes=not chains)
        return result, ChainedDecode() if chains else None

    def _chains(self, step: Step) -> bool:
        """This step ends by starting the next decode on the helper thread: overlap
        is on, the Step allows it, and every row knows where its next position goes."""
        return self.overlap and step.chain_next and len(self.batch) > 0 and \
            self.batch.knows_next()

    def _step_slots(self, step: Step) -> list[list[int]]:
        """The Step's decode slot of each row of the batch, in row order."""
        return [[row.slot] for row in check_decode(step, self.batch.rids, self.pool)]

    def _draft_arrays(self) -> list:
        """The draft model's writes (its pool's and its batch's), evaluated with the
        model's."""
        return self.drafter.arrays() if self.drafter is not None else []

    @property
    def verifies_drafts(self) -> bool:
        """Steps may carry drafts: the batch decodes in pages (recurrent states too:
        a verify whose rows drop positions replays the kept ones from the states
        before it, `PagedDecodeBatch.replay`)."""
        return self.batch.page > 0

    @property
    def _builds_ahead(self) -> bool:
        """A chained decode's graph can be built before this step's tokens are read:
        no row's grammar or thinking budget needs this step's token."""
        return not any(
            r.grammar is not None or (r.thinking is not None and r.thinking.live)
            for r in self.batch.rows)

    def reset(self) -> None:
        """Drop every request's state (after a failed step)."""
        self.close()
        self.batch.clear()
        if self.drafter is not None:
            self.drafter.clear()
        self.chained = None
        self._returned_at = None
        self._new_grammars = {}
        if self.disk is not None:
            self.disk.reset()

    def settle(self) -> None:
        """Return once nothing is in flight: the chained decode, if one was started,
        has computed (a worker group's own collectives then run alone)."""
        self._background.wait()
        mx.synchronize(self.stream)

    def close(self) -> None:
        """Wait for the chained decode, if one is computing (its errors are moot)."""
        try:
            self._background.wait(timeout=CLOSE_TIMEOUT)
            mx.synchronize(self.stream)   # its last tasks, queued when the job ended
        except Exception:
            pass

    def _wait_timing(self, arrived_at: float, busy_until: float) -> tuple:
        """(wait_ms, idle_ms); None after a step that left no request running (the
        wait was for work)."""
        if self._returned_at is None:
            return None, None
        wait = max(0.0, arrived_at - self._returned_at)
        idle = max(0.0, arrived_at - max(self._returned_at, busy_until))
        return wait * 1e3, idle * 1e3

    # ---- decode -----------------------------------------------------------

    def _launch_decode(self, slots: list[list[int]] | None = None) -> _Output:
        """Decode every row of the batch, lazily; the rows' next input is the result.
        `slots`: each row's slot for its input (None: a chained decode's, not sent
        yet: where the rows' pages put them)."""
        logits = self.batch.forward(self.model, slots=slots)
        live = [rid is not None for rid in self.batch.row_rids]
        sampled = self._sample(logits, self.batch.rows, live)
        self.batch.tokens = sampled.tokens
        return _Output(list(self.batch.row_rids), list(self.batch.rows), sampled,
                       self.batch.newest_kv(), direct=list(self.batch.direct))

    def _sample(self, logits: mx.array, rows: list[RowState], live=None,
                masks: Future | None = None, probs: bool = False) -> Sampled:
        """`sample`, with the constrained rows' masks (computed on the mask thread
        while this one evaluates the logits, the forward, then applied; `masks`:
        started already) and the tokens thinking budgets force; `probs`: with what
        each row sampled from."""
        if masks is None and self.grammars:
            masks = self.grammars.start_masks(rows, live)
        forced = thinking.forced_tokens([r.thinking for r in rows])
        if masks is None and forced is None:
            return sample(logits, rows, probs=probs)
        mask = None
        if masks is not None:
            mx.eval(logits)
            mask = allowed(masks.result(), logits.shape[-1])
        if forced is not None:
            mask = thinking.force(mask, forced, logits.shape[-1])
        return sample(logits, rows, mask, probs=probs)

    def _dispatch_chained(self, chained: ChainedDecode) -> None:
        """On the helper thread: queue the next decode of the batch (built now unless
        it was built ahead) with the step's pending pool writes. The job ends when
        the CPU backend's `async_eval` returns, as the last tasks are queued: the
        next Step's commit and the decode after it are built while those compute."""
        with mx.stream(self.stream):
            if chained.output is None:
                chained.output = self._launch_decode()
            # the pool writes in a call of their own: in one call with the decode's
            # arrays, async_eval returned only once all of it was computed (no tail).
            # Rows that read the pool write it in the decode itself: its own writes
            # (batch.pending_writes), which go with its arrays.
            if self.batch.pool is None:
                mx.async_eval(self.pool.arrays)
            mx.async_eval(_arrays([chained.output]), self.batch.pending_writes(),
                          self._draft_arrays())

    def _commit_decode(self, launched: _Output, step: Step) -> _Output:
        """Keep the launched decode's rows the Step names (the batch's rows, after its
        releases) and store their new KV at the Step's slots (and window ids)."""
        rows = check_decode(step, self.batch.rids, self.pool)
        running = [row.rid for row in rows]
        position = {rid: i for i, rid in enumerate(launched.rids) if rid is not None}
        direct = launched.direct or [0] * len(launched.rids)
        for row in rows:   # a chained decode wrote where the rows' pages put them
            if direct[position[row.rid]] not in (0, row.slot):
                raise SlotMismatch(f"step {step.step_id}: request {row.rid}'s slot "
                                   f"{row.slot} is not where its page puts its input "
                                   f"({direct[position[row.rid]]})")
        # the inputs the forward did not write to the pool (the padded layout's): to it
        pending = [row for row in rows if not direct[position[row.rid]]]
        if pending:
            ids = write_ids([row.slot for row in pending],
                            [row.window for row in pending] if self.pool.uses_windows else [])
            index = None if [row.rid for row in pending] == launched.rids else \
                mx.array([position[row.rid] for row in pending])
            self.pool.write_layers(launched.new_kv, ids, index)
        self.batch.booked({row.rid: row.chain_page for row in rows if row.chain_page})
        keep = None if launched.rids == running else mx.array([position[rid] for rid in running])
        if self.drafter is not None:   # the draft runs these positions when it next drafts
            self.drafter.decoded(running, [row.slot for row in rows])
        if keep is None:
            return launched
        s = launched.sampled
        rows = [launched.rows[position[rid]] for rid in running]
        return _Output(running, rows, Sampled(
            s.tokens[keep], s.logprobs[keep],
            None if s.top_ids is None else s.top_ids[keep],
            None if s.top_logprobs is None else s.top_logprobs[keep]))

    # ---- verify -----------------------------------------------------------

    def _verify(self, step: Step, chained: _Output | None) -> _Output:
        """Decode every row with its draft in one forward and keep, per row, the draft
        tokens the model's own choices agree with and its choice after them.

        Position j of a row is sampled as that row's next token would be were the
        draft's first j tokens already its output: its random key's count, its
        penalties' counts. A draft token is accepted while it equals the token so
        chosen, so every run is what decoding one token at a time chooses, seeded or
        not. A constrained row's positions are masked as its matcher would be
        after the draft tokens before each, its draft cut at the first token the
        grammar refuses; rows under a thinking budget verify no draft."""
        if chained is not None or not self.verifies_drafts:
            raise ValueError(f"step {step.step_id} carries drafts, but " + (
                "the decode after the step before was chained (chain_next)"
                if chained is not None else "this worker verifies none"))
        by_model = any(row.model_draft for row in step.decodes)
        if by_model and self.drafter is None:
            raise ValueError(f"step {step.step_id} asks for a draft model's drafts, but "
                             "this worker holds no draft model")
        decodes = check_decode(step, self.batch.rids, self.pool)
        check_drafts(step, self.pool, self.vocab_size)
        running = [d.rid for d in decodes]
        rows = self.batch.rows
        if by_model:   # the draft model's, as many as the Step asks of each row
            proposal = self.drafter.propose(
                running, rows, [d.model_draft for d in decodes], [d.slot for d in decodes],
                [d.draft_slots for d in decodes])
            asked = proposal.drafts
        else:
            proposal, asked = None, [d.draft for d in decodes]
        drafts = [_draft_for(row, d) for row, d in zip(rows, asked)]
        masks = self.grammars.start_draft_masks(rows, drafts) if self.grammars else None
        slots = [[d.slot] + d.draft_slots[:len(draft)] for d, draft in zip(decodes, drafts)]
        logits = self.batch.forward(self.model, drafts, slots)
        positions = [p for row, d in zip(rows, drafts) for p in _positions(row, d)]
        # (the forward wrote every verified position at its slot: the pages are the pool)
        sampled = self._sample(logits, positions, masks=masks, probs=proposal is not None)
        mx.eval(sampled.tokens, sampled.logprobs)
        chosen, starts = sampled.tokens.tolist(), _starts(drafts)
        tokens = [chosen[at:at + _agreed(d, chosen[at:at + len(d) + 1]) + 1]
                  for d, at in zip(drafts, starts)]
        if proposal is not None:   # sampled rows: rejection sampling against the draft's
            tokens_of = rejection_runs(rows, drafts, starts, sampled.probs, proposal.dists, chosen)
            tokens = [tokens_of.get(i, run) for i, run in enumerate(tokens)]
        runs = [len(run) for run in tokens]
        last = mx.array([run[-1] for run in tokens], dtype=sampled.tokens.dtype)
        if self.batch.needs_replay(runs, drafts):   # recurrent states counted rejected tokens
            self.batch.replay(self.model, runs, [row[:k] for row, k in zip(slots, runs)])
        self.batch.accept(runs, last)
        if proposal is not None:
            self.drafter.accept(runs, last)
        for row, d, run in zip(rows, drafts, tokens):
            if d:   # the real row takes its run (rows without a draft were sampled as such)
                _take_run(row, run)
        return self._run_output(running, sampled, logits, starts, tokens,
                                changed=proposal is not None)

    def _run_output(self, running: list[int], s: Sampled, logits: mx.array,
                    starts: list[int], tokens: list[list[int]], changed: bool) -> _Output:
        """A verify's output: each row's run, its tokens at its first positions.
        `changed`: a run may hold tokens other than the model's own choices there
        (rejection sampling), whose logprobs are read from the logits."""
        index = mx.array([at + j for at, run in zip(starts, tokens) for j in range(len(run))])
        flat = mx.array([t for run in tokens for t in run], dtype=s.tokens.dtype)
        logprobs = s.logprobs[index]
        if changed:
            raw = logits[index].astype(mx.float32)
            raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            logprobs = mx.take_along_axis(raw, flat[:, None], axis=-1)[:, 0]
        rows = [row for row, run in zip(self.batch.rows, tokens) for _ in run]
        return _Output(running, rows, Sampled(
            flat, logprobs, None if s.top_ids is None else s.top_ids[index],
            None if s.top_logprobs is None else s.top_logprobs[index]),
            runs=[len(run) for run in tokens])

    # ---- prefill ----------------------------------------------------------

    def _prefill(self, prefills: list[PrefillInput]) -> list[_Output]:
        check_prefills(prefills, self.batch.rids, self.pool, self.vocab_size)
        asked = prefills
        prefills = [self.disk.load(p) if self.disk is not None else without_disk(p)
                    for p in prefills]
        if self.drafter is not None:
            self._draft_disk_tokens(asked, prefills)
        self._new_grammars = {p.rid: self._grammar(p) for p in prefills
                              if p.needs_logits and p.sampling.grammar is not None}
        joins, draft_joins, outputs = [], [], []
        for group in plan_groups(prefills, self.prefill_step_size):
            joined = self._prefill_group(group)
            if joined is not None:
                joins.append(joined[0])
                outputs.append(joined[1])
                draft_joins += joined[2:]
        if joins:
            self.batch.add(joins)
        if draft_joins:
            self.drafter.join(draft_joins)
        return outputs

    def _draft_disk_tokens(self, asked: list[PrefillInput], loaded: list[PrefillInput]) -> None:
        """The draft model's KV of the tokens whose KV the model read from disk (the
        draft's pool holds none there): computed by the draft alone, written at
        their slots, before the prefills read them as their prefix."""
        runs = [replace(without_disk(p), input_ids=p.input_ids[:p.disk_tokens],
                        new_slot_ids=p.new_slot_ids[:p.disk_tokens], new_window_ids=[],
                        needs_logits=False, state_slot=0, snapshot_slot=0)
                for p, q in zip(asked, loaded)
                if len(q.prefix_slot_ids) > len(p.prefix_slot_ids)]   # a read that hit
        for group in plan_groups(runs, self.prefill_step_size):
            self.drafter.prefill(group, self.prefill_step_size, [])

    def _grammar(self, p: PrefillInput) -> RowGrammar:
        if self.grammars is None:
            raise ValueError(f"prefill {p.rid}: this worker cannot run constrained requests")
        return self.grammars.row(p.sampling.grammar, p.output_ids)

    def _prefill_group(self, group: list[PrefillInput]) -> tuple | None:
        """(the rows that join, their outputs[, the draft model's rows that join]);
        None when no row of the group joins yet (a chunk before a prompt's last)."""
        run = GroupPrefill(self.model, self.pool, group, self.prefill_step_size)
        keep = [i for i, p in enumerate(group) if p.needs_logits]
        draft_caches = (self.drafter.prefill(group, self.prefill_step_size, keep)
                        if self.drafter is not None else None)
        if not keep:
            return None
        caches, logits = run.caches, run.logits
        if len(keep) < len(group):
            idx = mx.array(keep)
            for cache in caches:
                batch_cache.keep_rows(cache, idx)
            logits = logits[idx]
        rows = [self._row_state(group[i]) for i in keep]
        sampled = self._sample(logits, rows)
        rids = [group[i].rid for i in keep]
        slots = [group[i].prefix_slot_ids + group[i].new_slot_ids for i in keep]
        joined = (JoinGroup(rids, rows, caches, sampled.tokens, slots), _Output(rids, rows, sampled))
        if draft_caches is None:
            return joined
        return joined + (JoinGroup(rids, rows, draft_caches, sampled.tokens, slots),)

    def _row_state(self, p: PrefillInput) -> RowState:
        return RowState(p.sampling, self._seed(p.sampling), p.num_generated,
                        RowPenalties.for_prefill(p, self.vocab_size),
                        self._new_grammars.pop(p.rid, None),
                        ThinkBudget.of(p.sampling, p.output_ids))

    def _seed(self, sampling) -> int:
        return sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)

    # ---- results ----------------------------------------------------------

    def _finalize(self, step_id: int, outputs: list[_Output], pool_writes: bool = False,
                  writes: bool = True) -> StepResult:
        """The outputs' tokens, evaluated. `writes`: with the batch's pending writes
        (False when the next decode was built ahead: its graph holds them), and the
        pool's with `pool_writes`. The pool writes are not in the tokens' graph:
        evaluated with the step (or with the chained decode), or lazy scatters pile
        up and pin every step's KV in memory."""
        mx.eval(_arrays(outputs), *((self.batch.pending_writes(),) if writes else ()),
                *((self.pool.arrays, self._draft_arrays()) if pool_writes else ()))
        self._outputs_at = time.perf_counter()
        result = StepResult(step_id, [], [], [])
        tops = []
        for o in outputs:
            tokens = o.sampled.tokens.tolist()
            _advance_rows(o.rows, tokens)
            if self.drafter is not None:
                self.drafter.read(o.rids, tokens, o.runs)
            result.rids += o.rids
            result.tokens += tokens
            result.logprobs += o.sampled.logprobs.tolist()
            tops += self._top_logprobs(o)
        if any(o.runs is not None for o in outputs):
            result.runs = [n for o in outputs for n in (o.runs or [1] * len(o.rids))]
        if any(t is not None for t in tops):
            result.top_logprobs = tops
        return result

    @staticmethod
    def _top_logprobs(o: _Output) -> list:
        if o.sampled.top_ids is None:
            return [None] * len(o.rids)
        ids, lps = o.sampled.top_ids.tolist(), o.sampled.top_logprobs.tolist()
        return [top_lists(ids[i], lps[i], r.params.top_logprobs) if r.params.top_logprobs
                else None for i, r in enumerate(o.rows)]


def _advance_rows(rows: list[RowState], tokens: list[int]) -> None:
    """The constrained rows' matchers (and thinking budgets) take the tokens the rows
    keep, before the next decode (chained or not) computes their masks."""
    for row, token in zip(rows, tokens):
        if row.grammar is not None:
            row.grammar.advance(token)
        if row.thinking is not None:
            row.thinking.advance(token)


def _draft_for(row: RowState, draft: list[int]) -> list[int]:
    """What of a row's draft is verified: none under a thinking budget (its count
    follows one token at a time); under a grammar, up to its first refused token."""
    if row.thinking is not None:
        return []
    return row.grammar.valid_draft(draft) if row.grammar is not None else draft


def _positions(row: RowState, draft: list[int]) -> list[RowState]:
    """The row's state at each position of its verify: at position j as if the
    draft's first j tokens were sampled (copies; the row itself without a draft)."""
    if not draft:
        return [row]
    out = []
    for j in range(len(draft) + 1):
        penalties = copy.copy(row.penalties)
        if penalties is not None:
            for token in draft[:j]:
                penalties.record(mx.array([token], dtype=mx.int32))
        out.append(replace(row, generated=row.generated + j, penalties=penalties))
    return out


def _agreed(draft: list[int], chosen: list[int]) -> int:
    """How many of the draft's tokens the chosen ones (one per position) confirm."""
    n = 0
    while n < len(draft) and chosen[n] == draft[n]:
        n += 1
    return n


def _starts(drafts: list[list[int]]) -> list[int]:
    """Each row's first position among a verify's positions."""
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += len(d) + 1
    return starts


def _take_run(row: RowState, tokens: list[int]) -> None:
    """A drafting row's state after its run: its count, its penalties' record."""
    row.generated += len(tokens)
    if row.penalties is not None:
        for token in tokens:
            row.penalties.record(mx.array([token], dtype=mx.int32))


def _arrays(outputs: list[_Output]) -> list[mx.array]:
    arrays = []
    for o in outputs:
        arrays += [o.sampled.tokens, o.sampled.logprobs]
        if o.sampled.top_ids is not None:
            arrays += [o.sampled.top_ids, o.sampled.top_logprobs]
    return arrays
