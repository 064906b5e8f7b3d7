"""The worker's side of the disk tier (--kv-disk): it reads and writes the entries
the scheduler names (runtime/kv_disk.py holds the files; scheduler_proc/disk_tier.py
decides).

Writes (`spill`) never wait: each spill's KV is gathered from the pool and evaluated
before the Step writes any slot (the slots may be handed out again in this very
Step), then queued for a writer thread that converts it to bytes and writes the
file. The queue is bounded in bytes; a spill that would pass the bound is skipped
and reported gone, as is one the store could not write.

Reads (`start_reads`) begin when the Step arrives, on a reader thread, while the
Step's decode runs; `load` then waits for them, writes the KV (and a recurrent
state, the window's KV) into the slots the scheduler booked, and hands back a
prefill that computes only the rest. A read that misses (no file, a damaged one:
the store logs and removes it) leaves the prefill as it was: its tokens are
computed, and the scheduler is told (`StepResult.disk_missed`).

An entry's arrays, as the pool stores them (kv_quant.py: float, or quantized
parts): `kv{layer}.{i}` the run's KV per pool layer (the keys' parts, then the
values'; windowed layers of a window pool excepted), `w{layer}.{i}` a resumable run's
window tail (the `window + 1` positions before its end), `s{leaf}.{i}` a resumable
run's recurrent state at its end. Bytes are stored as same-sized unsigned ints (any
dtype, bfloat16 too, round-trips).
"""

import logging
import math
import os
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxd.protocol import DiskRun, PrefillInput, Spill
from mlxd.runtime.kv_disk import ArrayBytes, Entry, KVDiskStore, fingerprint, run_name

from .kv_pool import KVPool

log = logging.getLogger("mlxd.worker.disk")

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SAMPLE = 64 * 1024           # bytes read at each sampled offset of a large weight file
SAMPLES = 16
WHOLE_FILE = 16 * 1024 * 1024   # smaller files are hashed whole
CLOSE_FLUSH_SECONDS = 3.0   # within the launcher's grace at stop (then SIGKILL)


def model_digest(path: str | os.PathLike) -> bytes:
    """What identifies a model's files without reading gigabytes: every file's name
    and size, small files whole, large ones at SAMPLES offsets."""
    root = Path(path)
    files = sorted(p for p in (root.rglob("*") if root.is_dir() else [root])
                   if p.is_file() and not p.name.startswith("."))
    parts = []
    for f in files:
        size = f.stat().st_size
        parts.append(f"{f.relative_to(root) if root.is_dir() else f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= WHOLE_FILE:
                parts.append(fh.read())
                continue
            for k in range(SAMPLES):
                fh.seek(k * (size - SAMPLE) // (SAMPLES - 1))
                parts.append(fh.read(SAMPLE))
    return b"\0".join(parts)


def store_fingerprint(model_path: str, kv_dtype: str, extra: str = "") -> str:
    """The fingerprint of what this worker's KV is computed with: the model's files,
    the KV dtype, `extra` (settings that change the numbers, e.g. dequantized
    weights), and the entry format (kv_disk.fingerprint adds it)."""
    return fingerprint(model_digest(model_path), kv_dtype, extra)


def default_max_bytes(root: str | os.PathLike) -> int:
    """Half of the free space where the directory lives, at start."""
    Path(root).mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(root).free // 2


def array_bytes(name: str, a: mx.array) -> ArrayBytes:
    raw = np.array(a.view(_UINT[a.dtype.size]) if a.dtype.size in _UINT else a)
    return ArrayBytes(name, str(a.dtype).removeprefix("mlx.core."), tuple(a.shape),
                      raw.tobytes())


def array_of(a: ArrayBytes) -> mx.array:
    """The array `a` holds (ValueError if its bytes do not fit its dtype and shape)."""
    dtype = getattr(mx, a.dtype, None)
    if not isinstance(dtype, mx.Dtype) or dtype.size not in _NP_UINT:
        raise ValueError(f"unknown dtype {a.dtype!r}")
    if math.prod(a.shape) * dtype.size != len(a.data):
        raise ValueError(f"{a.name}: {len(a.data)} bytes for shape {a.shape}")
    raw = np.frombuffer(a.data, _NP_UINT[dtype.size]).reshape(a.shape)
    return mx.array(raw).view(dtype)


class DiskIO:
    def __init__(self, store: KVDiskStore, pool: KVPool, queue_bytes: int):
        self.store = store
        self.pool = pool
        self.queue_bytes = queue_bytes
        self._lock = threading.Lock()      # the store is used by both threads
        self._queue: deque = deque()
        self._queued = 0                    # bytes waiting to be written
        self._wake = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self._reads: dict[int, Future] = {}
        self._gone: list[str] = []
        self._missed: list[int] = []
        self.written = self.skipped = 0

    def entries(self) -> list[str]:
        with self._lock:
            return list(self.store.index.entries)

    # ---- writing ------------------------------------------------------------------

    def spill(self, spills: list[Spill]) -> None:
        """Gather every spill's KV (evaluated now: the Step's writes come next) and
        queue it for the writer; skip (and report gone) what would pass the bound."""
        for spill in spills:
            name = run_name(spill.run)
            nbytes = len(spill.slot_ids) * self.pool.geometry.bytes_per_token
            if self._queued + nbytes > self.queue_bytes or not self._valid(spill):
                self.skipped += 1
                with self._lock:
                    self._gone.append(name)
                continue
            arrays = self._gather(spill)
            mx.eval([a for _, a in arrays])
            with self._wake:
                self._queue.append((spill, arrays, nbytes))
                self._queued += nbytes
                self._wake.notify()

    def _valid(self, spill: Spill) -> bool:
        """The spill's ids are the pool's (a bad one is skipped, not gathered)."""
        pool = self.pool
        try:
            pool.check_slots(spill.slot_ids)
            if spill.window_ids:
                pool.check_window_ids(spill.window_ids)
            if spill.snapshot_slot and pool.states is not None:
                pool.states.check_slots([spill.snapshot_slot])
        except ValueError as exc:
            log.error("kv disk: spill %s refused: %s", run_name(spill.run), exc)
            return False
        return not (spill.snapshot_slot and pool.states is None)

    def _gather(self, spill: Spill) -> list[tuple[str, mx.array]]:
        pool, out = self.pool, []
        slots = mx.array(spill.slot_ids, mx.int32)
        windows = mx.array(spill.window_ids, mx.int32) if spill.window_ids else None
        for layer in range(pool.geometry.num_layers):   # as stored (quantized or not)
            if pool.windowed(layer):
                if windows is not None:
                    out += [(f"w{layer}.{i}", a)
                            for i, a in enumerate(pool.read_raw(layer, windows))]
                continue
            out += [(f"kv{layer}.{i}", a) for i, a in enumerate(pool.read_raw(layer, slots))]
        if spill.snapshot_slot and pool.states is not None:
            slot = mx.array([spill.snapshot_slot])
            for leaf in range(len(pool.states.arrays)):
                for i, a in enumerate(pool.states.read(leaf, slot)):
                    out.append((f"s{leaf}.{i}", a[0]))
        return out

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    return
                spill, arrays, nbytes = self._queue.popleft()
            try:
                self._write(spill, arrays)
            except Exception:   # never let the writer die: the spill is lost, reported
                log.exception("kv disk: writing %s failed", run_name(spill.run))
                with self._lock:
                    self._gone.append(run_name(spill.run))
            finally:
                with self._wake:
                    self._queued -= nbytes
                    self._wake.notify_all()

    def _write(self, spill: Spill, arrays: list[tuple[str, mx.array]]) -> None:
        run = spill.run
        entry = Entry(run.parent, run.end, tuple(spill.tokens),
                      tuple(array_bytes(n, a) for n, a in arrays), run.resumable)
        del arrays
        with self._lock:
            written = self.store.put(entry)
            self._gone += self.store.take_gone()
            if written is None:
                self._gone.append(run_name(run))
            else:
                self.written += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if `timeout` passed first."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and self._queued == 0,
                                       timeout)

    # ---- reading ------------------------------------------------------------------

    def start_reads(self, prefills: list[PrefillInput]) -> None:
        """Begin reading the entries of every prefill that has disk runs."""
        for p in prefills:
            if p.disk_tokens:
                self._reads[p.rid] = self._reader.submit(self._read, p.disk_runs)

    def _read(self, runs: list[DiskRun]) -> list[Entry] | None:
        entries = []
        for run in runs:
            with self._lock:
                entry = self.store.get(run_name(run))
                self._gone += self.store.take_gone()
            if entry is None:
                return None
            entries.append(entry)
        return entries

    def load(self, p: PrefillInput) -> PrefillInput:
        """The prefill with its disk tokens' KV in the pool (it computes the rest), or
        unchanged but for its disk fields when a read missed."""
        if not p.disk_tokens:
            return p
        future = self._reads.pop(p.rid, None) or self._reader.submit(self._read, p.disk_runs)
        plain = without_disk(p)
        try:
            entries = future.result()
            state = self._place(p, entries) if entries is not None else None
        except Exception as exc:   # whatever a file holds, the prefill computes instead
            log.warning("kv disk: prefill %d cannot use its entries (%s: %s); computed",
                        p.rid, type(exc).__name__, exc)
            entries = None
        if entries is None:
            with self._lock:
                self._missed.append(p.rid)
            return plain
        n = p.disk_tokens
        return replace(plain, input_ids=p.input_ids[n:], new_slot_ids=p.new_slot_ids[n:],
                       prefix_slot_ids=p.prefix_slot_ids + p.new_slot_ids[:n],
                       prefix_window_ids=(p.prefix_window_ids + p.new_window_ids[:n]
                                          if p.new_window_ids else []),
                       new_window_ids=p.new_window_ids[n:],
                       state_from=p.disk_state_slot if state else p.state_from)

    def _place(self, p: PrefillInput, entries: list[Entry]) -> bool:
        """Write the entries' KV for positions [P, P + disk_tokens) (P: the prefix's
        length) at the prefill's new slots; True if a state was loaded too.
        ValueError when the entries do not hold what the prefill needs."""
        pool, start = self.pool, len(p.prefix_slot_ids)
        stop, n = start + p.disk_tokens, p.disk_tokens
        runs, at = [], p.disk_start
        for entry in entries:
            runs.append((at, entry))
            at += len(entry.tokens)
        if at < stop:
            raise ValueError("the entries end before the disk tokens")
        tokens = [t for _, e in runs for t in e.tokens][start - p.disk_start:stop - p.disk_start]
        if tokens != list(p.input_ids[:n]):
            raise ValueError("the entries hold other tokens")
        named = [dict((a.name, a) for a in e.arrays) for _, e in runs]
        slots = mx.array(p.new_slot_ids[:n], mx.int32)
        for layer in range(pool.geometry.num_layers):
            if pool.windowed(layer):
                self._place_window(p, layer, named[-1], at, start, n)
                continue
            parts = []
            for i, (shape, dtype) in enumerate(pool.raw_shapes(layer)):
                pieces = []
                for (first, entry), arrays in zip(runs, named):
                    lo = max(start, first) - first
                    hi = min(stop, first + len(entry.tokens)) - first
                    if hi > lo:
                        whole = _get(arrays, f"kv{layer}.{i}", (len(entry.tokens), *shape), dtype)
                        pieces.append(whole[lo:hi])
                parts.append(mx.concatenate(pieces) if len(pieces) > 1 else pieces[0])
            pool.write_raw(layer, slots, parts)
        return self._place_state(p, named[-1], at, stop)

    def _place_window(self, p: PrefillInput, layer: int, arrays: dict, end: int,
                      start: int, n: int) -> None:
        """The window tail of the last entry (positions [end - T, end)) at the new
        positions the scheduler gave a window slot."""
        rows = [i for i, w in enumerate(p.new_window_ids[:n]) if w]
        if not rows:
            return
        shapes = self.pool.raw_shapes(layer)
        tail = [_get(arrays, f"w{layer}.{i}", (None, *shape), dtype)
                for i, (shape, dtype) in enumerate(shapes)]
        count = tail[0].shape[0]
        if any(a.shape[0] != count for a in tail):
            raise ValueError("window tail parts of different lengths")
        first = end - count
        if start + rows[0] < first:
            raise ValueError("a window position the entry does not hold")
        index = mx.array([start + i - first for i in rows])
        ids = mx.array([p.new_window_ids[i] for i in rows], mx.int32)
        self.pool.write_raw(layer, ids, [a[index] for a in tail])

    def _place_state(self, p: PrefillInput, arrays: dict, end: int, stop: int) -> bool:
        states = self.pool.states
        if states is None:
            return False
        if not p.disk_state_slot or stop != end:
            raise ValueError("a recurrent model resumes only at a run's end, into a slot")
        slot = mx.array([p.disk_state_slot])
        for leaf, leaf_arrays in enumerate(states.arrays):
            loaded = []
            for i, a in enumerate(leaf_arrays):
                x = _get(arrays, f"s{leaf}.{i}")
                if tuple(x.shape) != tuple(a.shape[1:]):
                    raise ValueError("a state of another shape")
                loaded.append(x[None])
            states.write(leaf, slot, loaded)
        return True

    def take_news(self) -> tuple[list[str], list[int]]:
        """(entries gone since the last call, prefills whose reads missed)."""
        with self._lock:
            gone, self._gone = self._gone, []
            missed, self._missed = self._missed, []
        return gone, missed

    def reset(self) -> None:
        """A failed step: reads begun for it are dropped."""
        self._reads.clear()

    def close(self) -> None:
        """Finish the queued writes (a while at most), then let the directory go."""
        if not self.flush(CLOSE_FLUSH_SECONDS):
            log.warning("kv disk: writes still queued at exit were dropped")
        with self._wake:
            self._closing = True
            self._queue.clear()
            self._wake.notify_all()
        self._writer.join(timeout=5)
        self._reader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self.store.close()


def without_disk(p: PrefillInput) -> PrefillInput:
    """The prefill computing its disk tokens too (a worker without a disk tier)."""
    if not p.disk_tokens:
        return p
    return replace(p, disk_runs=[], disk_start=0, disk_tokens=0, disk_state_slot=0)


def _get(arrays: dict, name: str, shape: tuple | None = None,
         dtype: mx.Dtype | None = None) -> mx.array:
    """An entry's array by name; ValueError when it lacks it, or its shape is not
    `shape` (None in `shape`: any size there), or its dtype not `dtype`."""
    if name not in arrays:
        raise ValueError(f"the entry has no {name}")
    x = array_of(arrays[name])
    if shape is not None and (x.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(x.shape, shape))):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, not {shape}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} is {x.dtype}, not {dtype}")
    return x
