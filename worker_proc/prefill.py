"""Prefill: run new prompts through the model in left-padded groups.

Prompts of similar length share one forward. The transformer body runs on all
but the last token of each prompt and the full model (with its vocabulary
projection) only on the last, so no logits are computed for positions nobody
samples from — the same split mlx_lm's generate makes.
"""

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from protocol import PrefillInput

from .kv_pool import KVPool

PAD_TOKEN = 0


def plan_groups(prefills: list[PrefillInput], max_tokens: int) -> list[list[PrefillInput]]:
    """Prompts with a cached prefix, or longer than `max_tokens`, run alone; the rest
    are grouped by length with at most 2x padding and `max_tokens` padded tokens."""
    alone = [[p] for p in prefills if p.prefix_slot_ids or len(p.input_ids) > max_tokens]
    rest = sorted((p for p in prefills if not p.prefix_slot_ids and
                   len(p.input_ids) <= max_tokens), key=lambda p: len(p.input_ids))
    groups, current = [], []
    for p in rest:
        n = len(p.input_ids)   # the longest so far, since sorted
        if current and (n * (len(current) + 1) > max_tokens or
                        n > 2 * len(current[0].input_ids)):
            groups.append(current)
            current = []
        current.append(p)
    return alone + groups + ([current] if current else [])


class GroupPrefill:
    """One group's forward: caches, last-position logits, pool writes."""

    def __init__(self, model, pool: KVPool, group: list[PrefillInput], chunk: int):
        self.model = model
        self.group = group
        width = max(len(p.input_ids) for p in group)
        pads = [width - len(p.input_ids) for p in group]
        self.caches = [BatchKVCache(pads) for _ in range(pool.geometry.num_layers)]
        if group[0].prefix_slot_ids:   # only a group of one may carry a prefix
            self._load_prefix(pool, group[0].prefix_slot_ids)
        tokens = mx.array([[PAD_TOKEN] * pad + p.input_ids for pad, p in zip(pads, group)])
        self.logits = self._forward(tokens, chunk)
        self._write_pool(pool)

    def _load_prefix(self, pool: KVPool, slot_ids: list[int]) -> None:
        slots = mx.array(slot_ids)
        for layer, cache in enumerate(self.caches):
            keys, values = pool.read(layer, slots)
            cache.update_and_fetch(keys.swapaxes(0, 1)[None], values.swapaxes(0, 1)[None])

    def _forward(self, tokens: mx.array, chunk: int) -> mx.array:
        body_model = getattr(self.model, "model", self.model)
        body = tokens[:, :-1]
        for start in range(0, body.shape[1], chunk):
            body_model(body[:, start:start + chunk], cache=self.caches)
            if start + chunk < body.shape[1]:   # bound memory on long prompts
                mx.eval([c.state for c in self.caches])
        return self.model(tokens[:, -1:], cache=self.caches)[:, -1, :]

    def _write_pool(self, pool: KVPool) -> None:
        """Every row's new tokens sit right-aligned at the cache's current end."""
        end = self.caches[0].size()
        width = self.caches[0].keys.shape[2]
        rows = [(i * width + end - len(p.input_ids), len(p.input_ids))
                for i, p in enumerate(self.group)]
        flat = mx.array([start + j for start, n in rows for j in range(n)])
        slots = mx.array([s for p in self.group for s in p.new_slot_ids])
        for layer, cache in enumerate(self.caches):
            pool.write(layer, slots, _rows(cache.keys, flat), _rows(cache.values, flat))


def _rows(x: mx.array, flat: mx.array) -> mx.array:
    """`[B, H, T, D]` -> the `[n, H, D]` positions named by flat `b * T + t` indices."""
    b, h, t, d = x.shape
    return x.swapaxes(1, 2).reshape(b * t, h, d)[flat]
