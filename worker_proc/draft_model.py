"""Drafts from a smaller model (`--speculative draft`): the draft model runs in the
worker beside the model, over the same rows, and proposes each drafting row's next
tokens; the verify (model_runner) checks them as it checks n-gram drafts.

- **Its KV sits at the same pool slots** as the model's, in a pool of its own
  (`DraftModel.pool`, sized with the model's: the memory split counts both per
  token), and its rows read that pool in place, as the model's rows read theirs
  (paged_batch.py). So the scheduler books it without knowing it exists: a prefix
  hit, a retraction and resume, a chunked prefill read and write the draft's KV at
  the slots they read and write the model's, and the worker never derives a slot id.
- **It runs only in drafting steps.** Its batch (`DraftModel.batch`) holds the
  model's rows in their order; the positions the model decodes between drafting
  steps wait per row (`lag`: each token and the slot sent for it), so a draft that
  has stopped paying costs nothing.
- **A drafting step** (`propose`): one forward runs every row's lagging positions
  and its input and picks its first draft token, then one forward per further token,
  k in all after the first, k = the most tokens a row asks for (the last writes the
  k-th token's KV). Each pick is greedy rows' most likely token, sampled rows' a
  sample of the draft's distribution under the row's temperature and filters, with a
  key of the row's seed apart from the model's. The verify then keeps each row's
  run; the draft batch keeps the same positions (`accept`).
- **Exact**: a greedy row's draft is checked against the model's own choice at each
  position, as an n-gram draft is. A sampled row's is checked by rejection sampling
  (`rejection_runs`): draft token d at a position is accepted with probability
  min(1, p(d) / q(d)) (p: the model's distribution there, penalties, bias and grammar
  included; q: the draft's), the first refused one replaced by a sample of the
  residual max(0, p - q), and after a wholly accepted draft the model's own sample
  follows: the tokens are distributed as the model's alone. With a seed every draw
  has its key, so a request gives the same text whenever it is drafted the same way;
  not the text of speculation off, whose draws differ.
"""

import mlx.core as mx

from .decode import JoinGroup, UnsupportedModel
from .kv_pool import KVGeometry, KVPool
from .paged_batch import PagedDecodeBatch
from .prefill import GroupPrefill
from . import batch_cache
from .sampling import RowState, distribution, step_key

# the draft's sampling draws and the acceptance draws take keys of their own
DRAFT_STREAM = 0x6A09E667F3BCC908
ACCEPT_STREAM = 0xBB67AE8584CAA73B
_MASK64 = (1 << 64) - 1


def check_draft(geometry: KVGeometry, vocab_size: int, model_vocab_size: int) -> None:
    """A draft model keeps plain KV caches and embeds the model's token ids."""
    if geometry.state_shapes or geometry.max_window:
        raise UnsupportedModel("a draft model must keep plain KV caches (no sliding "
                               "window, no recurrent state)")
    if vocab_size != model_vocab_size:
        raise UnsupportedModel(f"the draft model's vocabulary ({vocab_size} ids) is not "
                               f"the model's ({model_vocab_size})")


def same_vocabulary(tokenizer, draft_tokenizer) -> bool:
    """The two tokenizers map every token to the same id."""
    return tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def drafter_for(model, capacity: int, geometry: KVGeometry | None = None) -> "DraftModel":
    """A DraftModel of `model` decoding in pages (UnsupportedModel where its attention
    cannot), its pool of `capacity` slots read in place. `geometry`: the model's,
    when probed already."""
    from .decode import decode_page_for, decode_rows
    from .model_runner import probe_geometry

    geometry = geometry or probe_geometry(model)
    page = decode_page_for(model, geometry, "paged")
    pool = KVPool(geometry, capacity, page=page)
    return DraftModel(model, pool, decode_rows(geometry, page, pool))


class DraftModel:
    """The draft model, its KV pool (the model's slots) and its decode batch (the
    model's rows, in their order). Between drafting steps it does nothing: each row's
    positions the model decoded meanwhile wait (`lag`: their tokens and slots) and are
    run at the row's next drafting step, in the forward that drafts its first token."""

    def __init__(self, model, pool: KVPool, batch: PagedDecodeBatch):
        self.model, self.pool, self.batch = model, pool, batch
        self.inputs: dict[int, int] = {}   # rid -> its next input token (read)
        self.lag: dict[int, list[tuple[int, int]]] = {}   # rid -> [(token, slot)] not run
        self._before: list[int] = []   # the rows' lengths before a drafting step
        self._caught_up: list[int] = []   # per row: lagging positions that step ran
        self._last_logits: mx.array | None = None

    # ---- rows joining and leaving ------------------------------------------

    def prefill(self, group: list, chunk: int, keep: list[int]) -> list:
        """The draft's prefill of a prefill group (its KV written to the pool at the
        group's slots): the caches of the rows `keep` (those that join; none when
        none does, as after a chunk before a prompt's last)."""
        run = GroupPrefill(self.model, self.pool, group, chunk)
        caches = run.caches
        if keep and len(keep) < len(group):
            idx = mx.array(keep)
            for cache in caches:
                batch_cache.keep_rows(cache, idx)
        return caches

    def join(self, groups: list[JoinGroup]) -> None:
        self.batch.add(groups)

    def remove(self, rids: set[int]) -> None:
        """Released rows leave (a row's lagging positions are never run: their
        pool slots keep no draft KV, which a later prefix hit drafts worse from,
        never wrongly)."""
        self.batch.remove(rids)
        for rid in rids:
            self.inputs.pop(rid, None)
            self.lag.pop(rid, None)

    def clear(self) -> None:
        self.batch.clear()
        self.inputs, self.lag = {}, {}

    # ---- following the model ---------------------------------------------------

    def read(self, rids: list[int], tokens: list[int], runs: list[int] | None = None) -> None:
        """A step's tokens were read (`runs[i]` of them row i's; default one each):
        each row's last is its next input."""
        at = 0
        for rid, n in zip(rids, runs or [1] * len(rids)):
            at += n
            if rid is not None:
                self.inputs[rid] = tokens[at - 1]

    def decoded(self, rids: list[int], slots: list[int]) -> None:
        """The model decoded these rows' inputs into `slots` without the draft."""
        for rid, slot in zip(rids, slots):
            self.lag.setdefault(rid, []).append((self.inputs[rid], slot))

    # ---- drafting ------------------------------------------------------------

    def propose(self, rids: list[int], rows: list[RowState], counts: list[int],
                slots: list[int], draft_slots: list[list[int]]) -> "Proposal":
        """Row i's next `counts[i]` tokens after its input, each picked from the
        draft's distribution there. The first forward runs each row's lagging
        positions and its input (at `slots[i]`) and picks its first draft token;
        then one forward per further token, the last for the KV of the last. Every
        position's KV goes to the pool in the forward that computes it (a draft
        token's at `draft_slots[i]`)."""
        most = max(counts)
        self._before = list(self.batch.lengths)
        runs = [[t for t, _ in self.lag.get(rid, [])] + [self.inputs[rid]] for rid in rids]
        self._catch_up(runs, [[s for _, s in self.lag.pop(rid, [])] + [slot]
                              for rid, slot in zip(rids, slots)])
        self._caught_up = [len(run) - 1 for run in runs]
        logits = self._last_logits
        picks, dists = [], []
        for j in range(most):
            tokens, probs = _pick(logits, rows, j)
            picks.append(tokens)
            dists.append(probs)
            self.batch.tokens = tokens
            # a row past its own count computes a scratch position (no slot: the sink)
            logits = self.batch.forward(self.model, slots=[d[j:j + 1] for d in draft_slots])
        mx.eval(picks)
        chosen = [p.tolist() for p in picks]
        return Proposal([[chosen[j][i] for j in range(n)] for i, n in enumerate(counts)], dists)

    def _catch_up(self, runs: list[list[int]], slots: list[list[int]]) -> None:
        """One forward of every row's `runs[i]` (its lagging tokens, then its input)
        at its next positions (their KV at `slots[i]`); keeps each row's last logits
        (`_last_logits`)."""
        self.batch.tokens = mx.array([run[0] for run in runs], dtype=mx.int32)
        logits = self.batch.forward(self.model, [run[1:] for run in runs], slots)
        ends, at = [], 0
        for run in runs:
            at += len(run)
            ends.append(at - 1)
        self._last_logits = logits[mx.array(ends)]

    def accept(self, kept: list[int], tokens: mx.array) -> None:
        """After the verify: row i keeps its lagging positions and the first
        `kept[i]` of the model's (its input and the accepted draft tokens); its next
        input is `tokens[i]`."""
        self.batch.accept([c + k for c, k in zip(self._caught_up, kept)], tokens,
                          held=self._before)

    def arrays(self) -> list:
        """What a step evaluates to complete the draft's writes."""
        return self.batch.pending_writes()


class Proposal:
    """A drafting step's draft tokens (per row) and the draft's distributions they
    were picked from (per draft position, `[rows, V]`)."""

    def __init__(self, drafts: list[list[int]], dists: list[mx.array]):
        self.drafts, self.dists = drafts, dists


def _keyed(seed: int, stream: int) -> int:
    return (seed ^ stream) & _MASK64


def _pick(logits: mx.array, rows: list[RowState], j: int) -> tuple[mx.array, mx.array]:
    """Each row's draft token at draft position j and the distribution it is
    picked from: the draft's logprobs under the row's temperature and filters (no
    penalties, bias or grammar: the verify applies the model's)."""
    logits = logits.astype(mx.float32)
    scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = distribution(scores, rows)
    noise = mx.stack([mx.random.gumbel((scores.shape[-1],),
                                       key=step_key(_keyed(r.seed, DRAFT_STREAM), r.generated + j))
                      for r in rows])
    tokens = mx.argmax(mx.log(probs) + noise, axis=-1)
    greedy = mx.array([r.params.greedy for r in rows])
    return mx.where(greedy, mx.argmax(scores, axis=-1), tokens).astype(mx.int32), probs


def rejection_runs(rows: list[RowState], drafts: list[list[int]], starts: list[int],
                   target: mx.array, dists: list[mx.array], chosen: list[int]) -> dict[int, list[int]]:
    """The runs of the sampled rows (index -> tokens) by rejection sampling: row i's
    draft token at position j is accepted with probability min(1, p/q) (p: `target`
    `[positions, V]` at the row's position `starts[i] + j`, q: `dists[j][i]`); the
    first refused one is replaced by a sample of max(0, p - q), normalised; a draft
    wholly accepted is followed by the model's own choice after it (`chosen`)."""
    pairs = [(i, j) for i, (r, d) in enumerate(zip(rows, drafts))
             if not r.params.greedy for j in range(len(d))]
    if not pairs:
        return {}
    p = target[mx.array([starts[i] + j for i, j in pairs])]
    q = mx.stack([dists[j][i] for i, j in pairs])
    d = mx.array([drafts[i][j] for i, j in pairs])[:, None]
    ratio = (mx.take_along_axis(p, d, axis=-1) / mx.take_along_axis(q, d, axis=-1))[:, 0]
    draws = mx.stack([mx.random.uniform(key=step_key(_keyed(rows[i].seed, ACCEPT_STREAM),
                                                     rows[i].generated + j))
                      for i, j in pairs])
    residual = mx.maximum(p - q, 0.0)
    noise = mx.stack([mx.random.gumbel((p.shape[-1],),
                                       key=step_key(rows[i].seed, rows[i].generated + j))
                      for i, j in pairs])
    resampled = mx.argmax(mx.log(residual) + noise, axis=-1)
    accepted = draws < ratio
    mx.eval(accepted, resampled)
    accepted, resampled = accepted.tolist(), resampled.tolist()
    steps: dict[int, list[tuple[bool, int, int]]] = {}
    for (i, j), ok, token in zip(pairs, accepted, resampled):
        steps.setdefault(i, []).append((ok, token, j))
    runs = {}
    for i, row_steps in steps.items():
        run = []
        for ok, token, j in row_steps:
            if not ok:   # the first refused draft token: the residual's sample instead
                run.append(token)
                break
            run.append(drafts[i][j])
        else:   # all accepted: the model's own choice after them
            run.append(chosen[starts[i] + len(drafts[i])])
        runs[i] = run
    return runs
