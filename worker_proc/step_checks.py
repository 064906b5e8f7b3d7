"""What the worker checks of a Step before it touches MLX: a failed check is a
`ValueError` the socket loop answers with a `WorkerError` (the step runs not at all).

The scheduler books every slot; the worker stores where it is told and refuses what
would corrupt the pool or crash MLX: ids out of range, a decode set that is not the
running set, a prefix without the window KV or the state it ends at, token ids the
model cannot embed (MLX does no bounds check on embedding lookups)."""

from mlxd.protocol import DecodeRow, PrefillInput, Step

from .kv_pool import KVPool


def check_decode(step: Step, running: list[int], pool: KVPool) -> list[DecodeRow]:
    """The Step's decode rows in the order of `running` (the batch's rows), once
    they are the running requests' and their slot, page and window ids the pool's."""
    rids = step.decode_rids
    if len(set(rids)) != len(rids) or set(rids) != set(running):
        raise ValueError(f"decode rids {sorted(rids)} do not match the "
                         f"running requests {sorted(running)}")
    rows = step.decodes
    pool.check_slots([r.slot for r in rows])
    pool.check_slots([r.chain_page * pool.page for r in rows if r.chain_page])   # whole pages
    pool.check_window_ids([r.window for r in rows if r.window])
    if pool.uses_windows and not all(r.window for r in rows):
        raise ValueError("decode rows must name a window id per decoded request")
    row_of = {r.rid: r for r in rows}
    return [row_of[rid] for rid in running]


def check_drafts(step: Step, pool: KVPool, vocab_size: int) -> None:
    """Draft tokens the model can embed, at slots the pool holds."""
    for row in step.decodes:
        if not _in_range(row.draft, vocab_size):
            raise ValueError(f"step {step.step_id}: a draft token outside [0, {vocab_size})")
        pool.check_slots(row.draft_slots)


def check_prefills(prefills: list[PrefillInput], running: list[int], pool: KVPool,
                   vocab_size: int) -> None:
    """Every prefill names a request not running, token ids in [0, vocab_size), and
    slot, window and state ids the pool holds."""
    rids = [p.rid for p in prefills]
    if len(set(rids)) != len(rids) or set(rids) & set(running):
        raise ValueError(f"prefill of a request that is already running: {rids}")
    for p in prefills:
        ids = (p.input_ids, p.prompt_tail, p.output_ids, p.stop_token_ids,
               p.sampling.bias_ids)
        if not all(_in_range(part, vocab_size) for part in ids):
            raise ValueError(f"prefill {p.rid}: token id outside [0, {vocab_size})")
        pool.check_slots(p.prefix_slot_ids)
        pool.check_slots(p.new_slot_ids)
        _check_window_ids(p, pool)
        _check_state_slots(p, pool)
        if p.disk_tokens and not (p.disk_runs and p.disk_tokens < len(p.input_ids) and
                                  p.disk_start <= len(p.prefix_slot_ids)):
            raise ValueError(f"prefill {p.rid}: disk_tokens needs disk_runs, a token left "
                             "to compute and a first run starting within the prefix")


def _check_window_ids(p: PrefillInput, pool: KVPool) -> None:
    """With a window pool: a window id per slot id, in range, and the prefix's last W
    positions held (the new tokens' windows reach them)."""
    pool.check_window_ids(p.prefix_window_ids + p.new_window_ids)
    if not pool.uses_windows:
        return
    if (len(p.new_window_ids) != len(p.new_slot_ids)
            or len(p.prefix_window_ids) != len(p.prefix_slot_ids)):
        raise ValueError(f"prefill {p.rid}: window ids must match the slot ids one for one")
    if 0 in p.prefix_window_ids[-pool.window:]:
        raise ValueError(f"prefill {p.rid}: a prefix without its window KV")


def _check_state_slots(p: PrefillInput, pool: KVPool) -> None:
    states = pool.states
    if states is None:
        if p.state_from or p.state_slot or p.snapshot_slot or p.disk_state_slot:
            raise ValueError(f"prefill {p.rid}: state slots for a model without state")
        return
    states.check_slots([p.state_from, p.state_slot, p.snapshot_slot, p.disk_state_slot])
    if p.prefix_slot_ids and not p.state_from:
        raise ValueError(f"prefill {p.rid}: a prefix without the state it ends at")


def _in_range(ids: list[int], vocab_size: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)
