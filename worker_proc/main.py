"""The worker process: a thin socket loop around the ModelRunner.

  input_addr   PULL  Step from the scheduler
  output_addr  PUSH  WorkerReady, then one StepResult (or WorkerError) per Step
  ready_addr   PUSH  Ready to the launcher once serving (optional): a worker that dies
                     after it is restarted, one that dies before is not

With `ranks` > 1 the process is rank `rank` of a tensor- or pipeline-parallel group
(group.py):
each rank has its own input address and runs every Step; rank 0 alone replies.
"""

import json
import logging
import os
import signal
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

import zmq

from mlxd.protocol import (
    Decoder, Ready, Step, WorkerError, WorkerLimits, WorkerReady, encode,
)
from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import WORKER, ServerFlags
from mlxd.runtime.lifecycle import Shutdown, die_with_parent, install_signal_handlers, setup_logging
from mlxd.runtime.sockets import (
    bind_pull, close_all, connect_push, decode_from, max_step_bytes, waking_receiver,
)

log = logging.getLogger("mlxd.worker")

DEFAULT_MAX_CONTEXT = 4096


@dataclass(frozen=True)
class WorkerConfig:
    PROCESS: ClassVar[str] = WORKER
    input_addr: str
    output_addr: str
    ready_addr: str = ""
    name: str = WORKER   # in its Ready to the launcher (one per engine and rank)
    rank: int = 0        # in its tensor-parallel group (MLX_RANK says the same)
    ranks: int = 1       # the group's size (--tp or --pp); 1: no group
    backend: str = "ring"   # the group's mx.distributed backend (a --hostfile's)
    flags: ServerFlags = field(default_factory=ServerFlags)   # those used_by the worker
    prefill_step_size: int = 2048   # most tokens of one prefill forward (not a user flag)
    parent_pid: int = 0


def model_max_context(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    text_config = config.get("text_config", config)
    return int(text_config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)


def loaded_blas() -> str:
    """Which BLAS this process runs on (Linux: read from the memory map)."""
    if not sys.platform.startswith("linux"):
        return "platform default (Accelerate/Metal)"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for marker in ("openblas", "mkl_rt", "libblis"):
        for line in maps.splitlines():
            # numpy's bundled OpenBLAS has prefixed symbols that mlx cannot use
            if marker in line and "numpy" not in line and "scipy" not in line:
                return line.split()[-1]
    return "reference BLAS bundled with mlx (slow)"


def build_runner(cfg: WorkerConfig):
    import mlx.core as mx

    from .decode import UnsupportedModel, decode_page_for, decode_rows, float_tail_bytes
    from .draft_model import drafter_for
    from .grammar import Grammars
    from .kv_pool import KVPool
    from .loading import is_quantized, load_for_serving
    from .memory import buffer_cache_bytes, kv_budget, memory_limit_bytes, window_split
    from .model_runner import ModelRunner, probe_geometry, probe_vocab_size
    from .verify_cost import measure_draft_cost, measure_verify_costs
    from .group import agree, form_group, layer_kinds, load_sharded, local_stage

    flags = cfg.flags
    limit = memory_limit_bytes(flags.mem_fraction, flags.mem_limit_gb)
    group = form_group(cfg.ranks, cfg.backend) if cfg.ranks > 1 else None
    if group is not None:   # weights as stored: each rank reads its part only
        model, tokenizer = load_sharded(flags.model, group, pipeline=flags.pp > 1)
        dequantize = False
    else:
        model, tokenizer, dequantize = load_for_serving(flags.model, flags.dequantize, limit)
    draft = load_draft(flags.draft_model, flags.dequantize, limit, model, tokenizer)
    weights_bytes = mx.get_active_memory()
    with local_stage(model):   # a pipeline stage probes its own layers
        geometry = with_kv_bits(probe_geometry(model), flags)
        page = decode_page_for(model, geometry, flags.decode_layout)   # 0: padded
        vocab_size = probe_vocab_size(model)
    max_context = model_max_context(flags.model)
    # Recurrent-state models: a state slot per running request, as many for snapshots
    # of prompts' states (prefix reuse), taken from memory first.
    state_slots = flags.max_running_requests if geometry.state_shapes else 0
    snapshot_slots = state_slots
    # the pool, the decode batch's rows and their copy while rows join
    state_bytes = (3 * state_slots + snapshot_slots + 1) * geometry.bytes_per_state
    # in pages every layer's KV is in the pool, where the decode reads it
    windows = None if page else window_split(geometry, max_context, flags.max_prefill_tokens,
                                             flags.window_capacity)
    pool_token_bytes = geometry.bytes_per_token - (windows.bytes_per_token if windows else 0)
    if draft is not None:   # the draft's KV sits at the same slots, in its own pool
        pool_token_bytes += draft[1].bytes_per_token
    # --kv-disk: spills wait for the writer in memory, up to this many bytes
    disk_queue = min(256 << 20, max(32 << 20, limit // 16)) if flags.kv_disk else 0
    # the float tail's rings have room for the longest verify
    slack = flags.spec_max_draft if flags.speculative != "off" else 0
    tail_bytes = float_tail_bytes(geometry, page, flags.kv_float_tail,
                                  flags.max_running_requests, slack)
    budget = kv_budget(limit, weights_bytes + state_bytes + disk_queue + tail_bytes,
                       max(1, pool_token_bytes),
                       flags.max_running_requests,
                       ceiling=flags.max_running_requests * max_context,
                       capacity=flags.kv_capacity, windows=windows, page=page)
    if group is not None:
        budget = agree(group, budget, settings_digest(cfg), layer_kinds(geometry, page))
    pool = KVPool(geometry, budget.capacity, state_slots + snapshot_slots,
                  budget.window_capacity, page=page or 1)
    cache_bytes = buffer_cache_bytes(page, budget.decode_cache_tokens, geometry.bytes_per_token)
    mx.set_cache_limit(cache_bytes)
    batch = decode_rows(geometry, page, pool, flags.preallocate_decode_pages,
                        float_tail=flags.kv_float_tail, max_rows=flags.max_running_requests,
                        tail_slack=slack)
    drafter = None
    if draft is not None:   # in pages beside the model's
        if not page:
            raise UnsupportedModel("--draft-model needs the paged decode layout, which "
                                   "this model or --decode-layout does not take")
        drafter = drafter_for(draft[0], budget.capacity, geometry=draft[1])
    runner = ModelRunner(model, pool, batch, vocab_size, cfg.prefill_step_size,
                         overlap=not flags.disable_overlap,
                         grammars=Grammars.for_model(tokenizer, vocab_size), drafter=drafter)
    if flags.kv_disk:
        runner.disk = open_disk_tier(flags, pool, dequantize, disk_queue,
                                     refused=group is not None)
    # measuring runs forwards (collectives, in a group) of rank 0's choosing: not there
    measured = runner.verifies_drafts and flags.speculative != "off" and \
        flags.spec_cost == "measured" and group is None
    limits = WorkerLimits(
        kv_capacity=pool.capacity, decode_cache_tokens=budget.decode_cache_tokens,
        max_context=max_context, vocab_size=vocab_size,
        bytes_per_token=geometry.bytes_per_token,
        kv_pool_bytes=max(1, pool.nbytes + (drafter.pool.nbytes if drafter else 0)),
        weights_bytes=weights_bytes, buffer_cache_bytes=cache_bytes,
        kv_dtype=kv_format_name(geometry), device=str(mx.default_device()), blas=loaded_blas(),
        quantized=is_quantized(model), dequantize=dequantize,
        overlap=not flags.disable_overlap, state_slots=state_slots,
        tensor_parallel=cfg.ranks if flags.pp == 1 else 1, pipeline_parallel=flags.pp,
        constraints=runner.grammars is not None,
        snapshot_slots=snapshot_slots,
        state_slot_bytes=geometry.bytes_per_state,
        window_sizes=[w for w in geometry.cache_layout.windows if w],
        window_capacity=pool.window_capacity, decode_page=page,
        verifies_drafts=runner.verifies_drafts,
        verify_costs=measure_verify_costs(model) if measured else [],
        draft_model=Path(flags.draft_model).name if draft is not None else "",
        draft_cost=measure_draft_cost(model, draft[0]) if measured and draft is not None else 0.0,
        kv_disk=runner.disk is not None,
        kv_disk_entries=runner.disk.entries() if runner.disk is not None else [],
        kv_float_tail=flags.kv_float_tail if tail_bytes else 0)
    return runner, limits, group


def open_disk_tier(flags: ServerFlags, pool, dequantize: bool, queue_bytes: int,
                   refused: bool):
    """The disk tier over `--kv-disk` (disk_io.py), its writes queued up to
    `queue_bytes` (reserved in the memory split). Refused (UnsupportedModel) for a
    worker group or beside a draft model, and when another server holds the
    directory."""
    from mlxd.runtime.kv_disk import KVDiskStore, StoreLocked

    from .decode import UnsupportedModel
    from .disk_io import DiskIO, default_max_bytes, store_fingerprint

    if refused:
        raise UnsupportedModel("--kv-disk does not work with --tp or --pp yet (their KV "
                               "is split between ranks)")
    if hasattr(signal, "SIGXFSZ"):   # past a file-size limit a write fails (skipped), not us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    fprint = store_fingerprint(flags.model, kv_format_name(pool.geometry),
                               f"dequantize={dequantize}")
    max_bytes = int(flags.kv_disk_max_gb * 2**30) or default_max_bytes(flags.kv_disk)
    try:
        store = KVDiskStore(flags.kv_disk, fprint, max_bytes)
    except StoreLocked as exc:
        raise UnsupportedModel(f"--kv-disk: {exc}") from None
    log.info("kv disk: %s (%d entries, %.1f of %.1f GiB)", store.dir, len(store.index),
             store.nbytes / 2**30, max_bytes / 2**30)
    return DiskIO(store, pool, queue_bytes)


def with_kv_bits(geometry, flags: ServerFlags):
    """The geometry with the stored KV's bits (--kv-bits, --kv-bits-k/-v); refused
    (UnsupportedModel) where the bits or the model's head dimensions do not fit."""
    from dataclasses import replace

    from .decode import UnsupportedModel

    bits = replace(geometry, k_bits=flags.kv_bits_k or flags.kv_bits,
                   v_bits=flags.kv_bits_v or flags.kv_bits, kv_group=flags.kv_group_size)
    try:
        bits.k_format, bits.v_format
    except ValueError as exc:
        raise UnsupportedModel(str(exc)) from None
    return bits


def kv_format_name(geometry) -> str:
    """The stored KV's dtype, as reported (and fingerprinted for the disk tier)."""
    k, v = geometry.k_format, geometry.v_format
    name = str(geometry.dtype).removeprefix("mlx.core.")
    if k.quantized or v.quantized:
        name += f", keys {k.describe()}, values {v.describe()}"
    return name


def settings_digest(cfg: WorkerConfig) -> int:
    """What every rank of a group must share to run a Step alike (the same forwards,
    so the same collectives in the same order): the model's config and the flags
    that shape the work."""
    flags = cfg.flags
    shared = [(Path(flags.model) / "config.json").read_text(), flags.decode_layout,
              flags.max_running_requests, flags.max_prefill_tokens, cfg.prefill_step_size,
              flags.window_capacity, flags.preallocate_decode_pages, flags.pp,
              flags.kv_bits, flags.kv_bits_k, flags.kv_bits_v, flags.kv_group_size,
              flags.kv_float_tail]
    return zlib.crc32(json.dumps(shared).encode()) & 0x7FFFFFFF


def load_draft(path: str, dequantize: str, limit: int, model, tokenizer):
    """--draft-model loaded beside `model`: (the draft model, its KV geometry), or None
    without one. A draft that keeps other than plain KV caches, or whose vocabulary is
    not the model's, is refused (UnsupportedModel)."""
    if not path:
        return None
    from .decode import UnsupportedModel
    from .draft_model import check_draft, same_vocabulary
    from .loading import load_for_serving
    from .model_runner import probe_geometry, probe_vocab_size

    draft, draft_tokenizer, _ = load_for_serving(path, dequantize, limit)
    geometry = probe_geometry(draft)
    check_draft(geometry, probe_vocab_size(draft), probe_vocab_size(model))
    if not same_vocabulary(tokenizer._tokenizer, draft_tokenizer._tokenizer):
        raise UnsupportedModel(f"the draft model {path} does not share the model's "
                               "tokenizer vocabulary")
    return draft, geometry


def serve(cfg: WorkerConfig, ctx: zmq.Context, sockets: list, wakeup) -> None:
    auth = None
    if cfg.input_addr.startswith("tcp://"):   # a rank on another machine (mlxd rank)
        from .group import bind_remote_steps

        flags = cfg.flags
        steps_in, auth = bind_remote_steps(ctx, cfg.input_addr, flags.curve_secret_key,
                                           max_step_bytes(model_max_context(flags.model),
                                                          flags.max_running_requests))
    else:
        steps_in = bind_pull(ctx, cfg.input_addr)
    results_out = connect_push(ctx, cfg.output_addr) if cfg.rank == 0 else None
    to_launcher = connect_push(ctx, cfg.ready_addr) if cfg.ready_addr else None
    sockets += [steps_in, results_out, to_launcher]
    if cfg.ranks > 1:   # watched from the start: the scheduler may connect while we load
        from .group import exit_when_scheduler_leaves

        exit_when_scheduler_leaves(steps_in)
    try:
        runner, limits, group = build_runner(cfg)
        rank = RankRole(group, cfg.flags.worker_timeout) if group is not None else None
        try:
            _serve_steps(runner, limits, waking_receiver(steps_in, wakeup), results_out,
                         to_launcher, cfg.name, rank)
        finally:
            runner.close()   # never exit while the helper thread is inside MLX
            if runner.disk is not None:   # queued writes finish; the directory is let go
                runner.disk.close()
    finally:
        if auth is not None:
            auth.stop()


class RankRole:
    """What a rank of a group does beside running Steps: a digest of its tokens, and
    a deadline on each step."""

    def __init__(self, group, deadline: float):
        from .group import Digest, Watchdog

        self.digest = Digest(group)
        self.watchdog = Watchdog(deadline)


def _serve_steps(runner, limits: WorkerLimits, recv, results_out: zmq.Socket | None,
                 to_launcher: zmq.Socket | None = None, name: str = WORKER,
                 rank: RankRole | None = None) -> None:
    """Run every Step; reply (rank 0, or the only worker) with its result. In a group,
    a failed step ends the rank (its collectives' peers are gone or out of step)."""
    log.info("ready: %s", limits.as_dict())
    if results_out is not None:
        results_out.send(encode(WorkerReady(limits)))
    if to_launcher is not None:
        to_launcher.send(encode(Ready(name)))
    decoder = Decoder(Step)
    while True:
        frame = recv()
        arrived_at = time.perf_counter()
        step = decode_from(decoder, frame, "scheduler", log)
        if step is None:
            continue
        reply = _run_step(runner, step, arrived_at, rank)
        if results_out is not None:
            results_out.send(encode(reply))
        if rank is not None and isinstance(reply, WorkerError):
            raise SystemExit(f"the worker group broke at step {step.step_id}: "
                             f"{reply.message}")


def _run_step(runner, step: Step, arrived_at: float, rank: RankRole | None):
    """The step's StepResult, or a WorkerError (a failed step must not kill a lone
    worker: its state is reset)."""
    if rank is not None:
        rank.watchdog.begin()
    try:
        if rank is not None and rank.digest.due:   # no collective may be in flight
            runner.settle()
            rank.digest.compare()
        reply = runner.run(step, arrived_at)
        if rank is not None:
            rank.digest.add(reply.rids, reply.tokens)
        log.debug("step %d: %d decode, %d prefill, %.1f ms compute, %.1f ms idle before",
                  step.step_id, len(step.decode_rids), len(step.prefills),
                  reply.timing.compute_ms, reply.timing.idle_ms or 0.0)
    except Exception as exc:
        log.error("step %d failed:\n%s", step.step_id, traceback.format_exc())
        runner.reset()
        reply = WorkerError(step.step_id, f"{type(exc).__name__}: {exc}")
    finally:
        if rank is not None:
            rank.watchdog.end()
    return reply


def main(argv=None) -> None:
    cfg = parse_config(WorkerConfig, "mlxd MLX worker process", argv)
    setup_logging("worker", cfg.flags.log_level)
    die_with_parent(cfg.parent_pid)
    wakeup = install_signal_handlers()
    log.info("pid %d, LD_PRELOAD=%s", os.getpid(), os.environ.get("LD_PRELOAD", ""))
    ctx = zmq.Context()
    sockets: list = []
    try:
        serve(cfg, ctx, sockets, wakeup)
    except Shutdown as why:
        log.info("shutting down (%s)", why)
    finally:
        close_all(ctx, *sockets)
