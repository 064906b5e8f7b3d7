"""Prefill: run new prompts through the model in left-padded groups.

Prompts of similar length share one forward. The transformer body runs on all
but the last token of each prompt and the full model (with its vocabulary
projection) only on the last, so no logits are computed for positions nobody
samples from — the same split mlx_lm's generate makes.
"""

import mlx.core as mx

from mlxd.protocol import PrefillInput
from mlxd.runtime.kv_layout import cache_width

from . import batch_cache
from .kv_pool import KVPool, write_ids

PAD_TOKEN = 0


def plan_groups(prefills: list[PrefillInput], max_tokens: int) -> list[list[PrefillInput]]:
    """Prefills run in left-padded groups of at most `max_tokens` new tokens.
    Without a cached prefix, prompts group by length (at most 2x padding). With
    one, a group needs the same number of new tokens (their columns must line
    up); prefixes of different lengths are left-padded (the scheduler's decode
    width budget bounds that memory). Longer than `max_tokens`: alone, in chunks."""
    plain = sorted((p for p in prefills if not p.prefix_slot_ids),
                   key=lambda p: len(p.input_ids))
    cached = sorted((p for p in prefills if p.prefix_slot_ids),
                    key=lambda p: (len(p.input_ids), len(p.prefix_slot_ids)))
    groups: list[list[PrefillInput]] = []
    for p in plain + cached:
        group = groups[-1] if groups else None
        if group is None or not _fits(group, p, max_tokens):
            groups.append([p])
        else:
            group.append(p)
    return groups


def _fits(group: list[PrefillInput], p: PrefillInput, max_tokens: int) -> bool:
    first, n = group[0], len(p.input_ids)   # p is the longest so far (sorted)
    if bool(first.prefix_slot_ids) != bool(p.prefix_slot_ids) or n > max_tokens:
        return False
    # A row that starts from a stored state takes no token padding: padding would
    # run through its recurrent layers after the state, not before it.
    if (p.prefix_slot_ids or p.state_from or first.state_from) and n != len(first.input_ids):
        return False
    return n * (len(group) + 1) <= max_tokens and n <= 2 * len(first.input_ids)


class GroupPrefill:
    """One group's forward: caches, last-position logits, pool writes."""

    def __init__(self, model, pool: KVPool, group: list[PrefillInput], chunk: int):
        self.model = model
        self.group = group
        width = max(len(p.prefix_slot_ids) + len(p.input_ids) for p in group)
        new = max(len(p.input_ids) for p in group)
        pads = [width - len(p.prefix_slot_ids) - len(p.input_ids) for p in group]
        layout = pool.geometry.cache_layout
        self.caches = batch_cache.model_caches(layout, pads,
                                               [new - len(p.input_ids) for p in group])
        self.kv = batch_cache.kv_leaves(layout, self.caches)
        self.states = batch_cache.state_leaves(layout, self.caches)
        if group[0].prefix_slot_ids:   # all rows have one, and equally many new tokens
            self._load_prefixes(pool)
        if pool.states is not None and any(p.state_from for p in group):
            self._load_states(pool)
        tokens = mx.array([[PAD_TOKEN] * (new - len(p.input_ids)) + p.input_ids
                           for p in group])
        self.logits = self._forward(tokens, chunk)
        self._write_pool(pool)
        for field in ("state_slot", "snapshot_slot"):   # (a draft model's pool has none)
            if pool.states is not None and any(getattr(p, field) for p in group):
                self._write_states(pool, field)

    def _load_prefixes(self, pool: KVPool) -> None:
        """Gather every row's cached prefix, right-aligned, straight into cache
        buffers with room for the new tokens (padding and room read slot 0), so
        the forward writes in place and nothing is copied twice. Windowed layers
        with a window pool read at the prefix's window ids (0, zeros, beyond the
        window)."""
        width = max(len(p.prefix_slot_ids) for p in self.group)
        new = max(len(p.input_ids) for p in self.group)
        room = cache_width(width + new) - width

        def aligned(field: str) -> mx.array:
            return mx.array([[0] * (width - len(p.prefix_slot_ids)) + getattr(p, field)
                             + [0] * room for p in self.group])

        slots = aligned("prefix_slot_ids")
        windows = aligned("prefix_window_ids") if pool.uses_windows else None
        for layer, cache in enumerate(self.kv):
            ids = windows if pool.windowed(layer) else slots
            keys, values = (mx.contiguous(x.swapaxes(0, 1)) for x in pool.read(layer, ids))
            batch_cache.load_prefix(cache, keys, values, width)

    def _load_states(self, pool: KVPool) -> None:
        """Every row's recurrent state at the end of its prefix (slot 0: zeros)."""
        slots = mx.array([p.state_from for p in self.group])
        for leaf, cache in enumerate(self.states):
            batch_cache.load_state(cache, pool.states.read(leaf, slots))

    def _write_states(self, pool: KVPool, field: str) -> None:
        """Store the rows' states after their input at the slots `field` names."""
        rows = [i for i, p in enumerate(self.group) if getattr(p, field)]
        index = mx.array(rows)
        slots = mx.array([getattr(self.group[i], field) for i in rows])
        for leaf, cache in enumerate(self.states):
            pool.states.write(leaf, slots, [a[index] for a in batch_cache.state_arrays(cache)])

    def _forward(self, tokens: mx.array, chunk: int) -> mx.array:
        body_model = getattr(self.model, "model", self.model)
        body = tokens[:, :-1]
        for start in range(0, body.shape[1], chunk):
            body_model(body[:, start:start + chunk], cache=self.caches)
            if start + chunk < body.shape[1]:   # bound memory on long prompts
                mx.eval(batch_cache.cache_arrays(self.caches))
        return self.model(tokens[:, -1:], cache=self.caches)[:, -1, :]

    def _write_pool(self, pool: KVPool) -> None:
        """Every row's new tokens sit right-aligned in the last `n_max` columns."""
        n_max = max(len(p.input_ids) for p in self.group)
        flat = mx.array([i * n_max + n_max - len(p.input_ids) + j
                         for i, p in enumerate(self.group) for j in range(len(p.input_ids))])
        ids = write_ids([s for p in self.group for s in p.new_slot_ids],
                        [w for p in self.group for w in p.new_window_ids])
        kv = [tuple(_positions(x) for x in batch_cache.last_positions(cache, n_max))
              for cache in self.kv]
        pool.write_layers(kv, ids, flat)


def _positions(x: mx.array) -> mx.array:
    """`[B, H, T, D]` -> `[B * T, H, D]`: position `b * T + t` is row b's t-th."""
    b, h, t, d = x.shape
    return x.swapaxes(1, 2).reshape(b * t, h, d)
