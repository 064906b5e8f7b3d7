"""ModelRunner: executes Steps on the model. MLX only; no sockets.

The scheduler's slot ids are the only way KV reaches the pool: prefill KV is
written at `new_slot_ids`, each decode step's input-token KV at
`decode_slot_ids`. The runner never derives a slot id on its own.
"""

import random
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from protocol import PrefillInput, Step, StepResult

from .decode_batch import DecodeBatch, Joiner
from .kv_pool import KVGeometry, KVPool
from .sampling import RowState, Sampled, sample, top_lists


class UnsupportedModel(ValueError):
    pass


def probe_geometry(model) -> KVGeometry:
    """Run one token through the model to learn its KV layout and dtype."""
    cache = make_prompt_cache(model)
    kinds = {type(c).__name__ for c in cache if type(c) is not KVCache}
    if kinds:
        raise UnsupportedModel(
            f"mlxd serves models whose layers all use plain KV caches; this one uses {kinds}")
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    k, v = cache[0].keys, cache[0].values
    return KVGeometry(len(cache), k.shape[1], k.shape[3], v.shape[3], k.dtype)


@dataclass
class _Output:
    rids: list[int]
    rows: list[RowState]
    sampled: Sampled


class ModelRunner:
    def __init__(self, model, pool: KVPool, prefill_step_size: int = 2048,
                 rng: random.Random | None = None):
        self.model = model
        self.pool = pool
        self.prefill_step_size = prefill_step_size
        self.batch = DecodeBatch()
        self._rng = rng or random.Random()

    # ---- the step ---------------------------------------------------------

    def run(self, step: Step) -> StepResult:
        start = time.perf_counter()
        self.batch.remove(set(step.releases))
        outputs = []
        if step.decode_rids:
            outputs.append(self._decode(step.decode_rids, step.decode_slot_ids))
        elif len(self.batch):
            raise ValueError(f"step {step.step_id} decodes nothing but "
                             f"{len(self.batch)} requests are running")
        joiners = [j for j in map(self._prefill, step.prefills) if j is not None]
        outputs += [_Output([j.rid], [j.row], sampled) for j, sampled in joiners]
        if joiners:
            self.batch.add([j for j, _ in joiners])
        result = self._finalize(step.step_id, outputs)
        result.timing["compute_ms"] = (time.perf_counter() - start) * 1e3
        return result

    def reset(self) -> None:
        """Drop every request's state (after a failed step)."""
        self.batch.clear()

    # ---- decode -----------------------------------------------------------

    def _decode(self, rids: list[int], slot_ids: list[int]) -> _Output:
        slot_of = dict(zip(rids, slot_ids))
        if len(slot_of) != len(rids) or slot_of.keys() != set(self.batch.rids):
            raise ValueError(f"decode rids {sorted(slot_of)} do not match the running "
                             f"requests {sorted(self.batch.rids)}")
        self.pool.check_slots(slot_ids)
        logits = self.batch.forward(self.model)
        slots = mx.array([slot_of[rid] for rid in self.batch.rids])
        for layer in range(len(self.batch.caches)):
            self.pool.write(layer, slots, *self.batch.newest_kv(layer))
        sampled = sample(logits, self.batch.rows)
        self.batch.tokens = sampled.tokens
        return _Output(list(self.batch.rids), list(self.batch.rows), sampled)

    # ---- prefill ----------------------------------------------------------

    def _prefill(self, p: PrefillInput) -> tuple[Joiner, Sampled] | None:
        self.pool.check_slots(p.prefix_slot_ids)
        self.pool.check_slots(p.new_slot_ids)
        cache = make_prompt_cache(self.model)
        if p.prefix_slot_ids:
            self._load_prefix(cache, p.prefix_slot_ids)
        start = len(p.prefix_slot_ids)
        logits = self._forward_chunks(p.input_ids, cache)
        slots = mx.array(p.new_slot_ids)
        end = start + len(p.input_ids)
        for layer, c in enumerate(cache):
            self.pool.write(layer, slots, c.keys[0, :, start:end, :].swapaxes(0, 1),
                            c.values[0, :, start:end, :].swapaxes(0, 1))
        if not p.needs_logits:
            return None
        seed = p.sampling.seed if p.sampling.seed is not None else self._rng.getrandbits(63)
        row = RowState(p.sampling, seed)
        sampled = sample(logits, [row])
        return Joiner(p.rid, cache, sampled.tokens, row), sampled

    def _load_prefix(self, cache: list[KVCache], slot_ids: list[int]) -> None:
        slots = mx.array(slot_ids)
        for layer, c in enumerate(cache):
            keys, values = self.pool.read(layer, slots)
            c.update_and_fetch(keys.swapaxes(0, 1)[None], values.swapaxes(0, 1)[None])

    def _forward_chunks(self, input_ids: list[int], cache: list[KVCache]) -> mx.array:
        """Run the prompt through the model in bounded chunks; last-position logits."""
        n = self.prefill_step_size
        for i in range(0, len(input_ids), n):
            logits = self.model(mx.array(input_ids[i:i + n])[None], cache=cache)
            if i + n < len(input_ids):
                mx.eval([c.state for c in cache])
        return logits[:, -1, :]

    # ---- results ----------------------------------------------------------

    def _finalize(self, step_id: int, outputs: list[_Output]) -> StepResult:
        arrays = []
        for o in outputs:
            arrays += [o.sampled.tokens, o.sampled.logprobs]
            if o.sampled.top_ids is not None:
                arrays += [o.sampled.top_ids, o.sampled.top_logprobs]
        # The pool writes are not in the tokens' graph: evaluate them with the step,
        # or lazy scatters pile up and pin every step's KV in memory.
        mx.eval(arrays, self.pool.keys, self.pool.values)
        result = StepResult(step_id, [], [], [])
        tops = []
        for o in outputs:
            result.rids += o.rids
            result.tokens += o.sampled.tokens.tolist()
            result.logprobs += o.sampled.logprobs.tolist()
            tops += self._top_logprobs(o)
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
