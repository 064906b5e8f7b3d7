"""One rank of a worker group (`--tp N` or `--pp N`) over mx.distributed.

Every rank receives every Step and runs it alike (the same model split, the same
seeds: sampling is identical on all ranks); rank 0 alone replies. The ranks meet only
inside the model's collectives (mlx_lm's `shard()` puts an all_sum after each
attention and MLP; its `pipeline()` passes the hidden state from stage to stage and
gathers the last stage's on every rank), plus the few this module adds: agreeing on
the KV budget at start (the group's capacity is its smallest rank's) and comparing a
digest of the sampled tokens every DIGEST_STEPS steps, so that ranks that diverge are
an error, not silent. A group cannot be formed again inside a process: whatever breaks it (a peer
lost, a step past the deadline, a digest mismatch) ends the rank, and the launcher
restarts the whole group.
"""

import contextlib
import logging
import os
import threading
import time
import zlib
from dataclasses import replace

import mlx.core as mx
import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.runtime.keys import own_key_authenticator, read_secret_key, serve_with_curve
from mlxd.runtime.sockets import cap_frames, heartbeat

log = logging.getLogger("mlxd.worker")

DIGEST_STEPS = 16   # steps between digest comparisons
GROUP_EXIT_CODE = 3
ZAP_DOMAIN = "mlxd-ranks"


class GroupBroken(RuntimeError):
    """The group cannot go on (ranks diverged); the rank exits and is restarted."""


def form_group(ranks: int, backend: str = "ring") -> mx.distributed.Group:
    """Join the group the environment describes (the launcher, or `mlxd rank`, sets
    it: MLX_RANK and MLX_HOSTFILE for the ring; MLX_IBV_DEVICES and
    MLX_JACCL_COORDINATOR for JACCL)."""
    mx_backend = "jaccl" if backend.startswith("jaccl") else backend
    try:
        group = mx.distributed.init(strict=True, backend=mx_backend)
    except RuntimeError as exc:
        raise GroupBroken(f"the {backend} backend of mx.distributed cannot start here "
                          f"({exc})" + (": JACCL needs macOS 26.2 or later with RDMA over "
                                        "Thunderbolt 5 enabled (see the README)"
                                        if mx_backend == "jaccl" else "")) from None
    if group.size() != ranks:
        raise GroupBroken(f"the ring has {group.size()} ranks, not {ranks}")
    log.info("rank %d of %d joined the group (%s)", group.rank(), group.size(), backend)
    return group


def load_sharded(path: str, group: mx.distributed.Group, pipeline: bool = False):
    """(model, tokenizer): the weights loaded lazily, split with mlx_lm's `shard()`
    (or, with `pipeline`, its `model.model.pipeline()`: this rank's stage of the
    layers), then read: each rank reads only its part."""
    from mlx_lm import load

    model, tokenizer = load(path, lazy=True)
    if pipeline:
        body = getattr(model, "model", None)
        if not hasattr(body, "pipeline"):
            raise GroupBroken(f"the model at {path} has no pipeline split")
        body.pipeline(group)
        stage_forwards(body)
        log.info("rank %d runs layers %d to %d", group.rank(), body.start_idx,
                 body.end_idx - 1)
    elif hasattr(model, "shard"):
        model.shard(group)
    else:
        raise GroupBroken(f"the model at {path} has no tensor-parallel split")
    mx.eval(model.parameters())
    return model, tokenizer


def stage_forwards(body) -> None:
    """Queue every forward of a pipeline stage for evaluation as soon as it is built.

    A stage's graph differs per rank (rank r receives from r+1, runs its layers, sends
    to r-1; all gather the result), so when several forwards are evaluated together
    (a step's prefills and decode, a prompt's chunks) each rank may order their
    sends, receives and gathers differently and the group deadlocks. Evaluating each
    forward when it is built fixes the order: the Step's order, the same on every
    rank. mlx_lm's model bodies are called by their Model (and by the chunked
    prefill directly), so the body's class is the one place to do it."""
    base = type(body)

    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        mx.async_eval(out)
        return out

    body.__class__ = type(f"Staged{base.__name__}", (base,), {"__call__": __call__})


def agree(group: mx.distributed.Group, budget, settings: int, layers: int):
    """The KV budget every rank can hold: each figure the group's smallest; first,
    every rank must run with the same `settings` (a digest: see the worker's
    `settings_digest`) and hold the same kinds of layers (`layers`: see
    `layer_kinds`), or the group refuses to start."""
    if not _same(group, settings):
        raise GroupBroken("the ranks of the group run with different settings (model "
                          "config, --decode-layout, --max-running-requests, "
                          "--max-prefill-tokens, --window-capacity, --pp, --kv-bits, "
                          "--kv-bits-k/-v, --kv-group-size or --kv-float-tail): start "
                          "every rank with the same")
    if not _same(group, layers):
        raise GroupBroken("the pipeline stages hold different kinds of layers (attention, "
                          "sliding-window attention, recurrent state): every stage must "
                          "hold each kind the model has, so that every rank runs a Step "
                          "the same way; serve this model with another --pp (or without)")
    figures = mx.array([budget.capacity, budget.decode_cache_tokens,
                        budget.window_capacity], mx.int64)
    capacity, cache, window = (int(x) for x in mx.distributed.all_min(figures, group=group)
                               .tolist())
    return replace(budget, capacity=capacity, decode_cache_tokens=cache,
                   window_capacity=window)


def _same(group: mx.distributed.Group, value: int) -> bool:
    """Whether every rank of the group holds the same `value` (a 63-bit digest)."""
    mine = mx.array([value], mx.int64)
    return (mx.distributed.all_min(mine, group=group).item()
            == mx.distributed.all_max(mine, group=group).item())


def layer_kinds(geometry, page: int) -> int:
    """A digest of what decides how a rank runs a Step: which kinds of layers it holds
    (KV, sliding windows and their sizes, recurrent states and their shapes) and its
    decode layout, not how many of each. Pipeline stages hold different layers; each
    must still run the Step's forwards alike, or their sends and receives mismatch."""
    layout = geometry.cache_layout
    kinds = (layout.num_kv > 0, sorted(set(layout.windows)),
             sorted({repr(shapes) for shapes in geometry.state_shapes}), page)
    return zlib.crc32(repr(kinds).encode()) & 0x7FFFFFFF


@contextlib.contextmanager
def local_stage(model):
    """Within: a pipeline stage's forwards run its own layers only, with no sends,
    receives or gathers: for the start-up probes (cache kinds, KV shapes, vocabulary,
    whether decode in pages reaches every layer), whose number and shapes depend on
    the rank's layers, so the ranks would not meet in them. No-op for other models."""
    body = getattr(model, "model", None)
    placed = getattr(body, "pipeline_size", 1), getattr(body, "pipeline_rank", 0)
    if placed[0] > 1:
        body.pipeline_size, body.pipeline_rank = 1, 0
    try:
        yield
    finally:
        if placed[0] > 1:
            body.pipeline_size, body.pipeline_rank = placed


def bind_remote_steps(ctx: zmq.Context, address: str, key_file: str, max_bytes: int):
    """(the Step socket of a rank on another machine, its authenticator): a CURVE
    server under the server's key pair, admitting that pair's key only (the
    scheduler's), with heartbeats, its frames capped at `max_bytes`."""
    if not key_file:
        raise SystemExit("mlxd worker: a Step socket over tcp needs --curve-secret-key")
    pair = read_secret_key(key_file)
    auth = own_key_authenticator(ctx, pair, ZAP_DOMAIN, lambda: log.warning(
        "refused a connection to the Step socket: its key is not the server's"))
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    serve_with_curve(sock, pair)
    sock.zap_domain = ZAP_DOMAIN.encode()
    heartbeat(sock)
    log.info("Step frames over %d bytes are refused", cap_frames(sock, max_bytes))
    sock.bind(address)
    return sock, auth


def exit_when_scheduler_leaves(steps_in: zmq.Socket) -> None:
    """A rank ends when the scheduler's connection to it ends: the scheduler reopens
    its links when the group broke (a rank died), and a rank idle in its receive would
    otherwise never notice that its ring is gone; its end has the launcher (rank 0,
    or every rank here) or `mlxd rank` start the next group.

    On this machine's ipc only the scheduler can connect, so its disconnection is the
    sign. A remote rank's tcp port can be reached by anyone on the network, whose
    connections (refused by CURVE) come and go: there the sign is the scheduler
    connecting a second time (it reopened its links, or it is a new scheduler), since
    only the server's key pair completes a handshake."""
    remote = steps_in.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://")
    monitor = steps_in.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED if remote else zmq.EVENT_DISCONNECTED)

    def watch():
        try:
            for _ in range(2 if remote else 1):
                event = parse_monitor_message(monitor.recv_multipart())
        except zmq.ContextTerminated:   # the process is ending on its own (a start that
            monitor.close(linger=0)     # failed): let the context's term() finish
            return
        _end_rank(f"the scheduler's connection ended or was made anew (event "
                  f"{event['event']}): the group is being restarted; this rank exits")

    threading.Thread(target=watch, name="group-watch", daemon=True).start()


def _end_rank(why: str) -> None:
    """Exit at once, from any thread (the main one may be stuck in a collective)."""
    log.error("%s", why)
    logging.shutdown()
    os._exit(GROUP_EXIT_CODE)


class Digest:
    """A running CRC of the tokens a rank sampled, compared across the group every
    DIGEST_STEPS steps (at the same step on every rank: they run the same Steps).
    The comparison is a collective of its own: it runs only when no other is in
    flight (`due` is checked before a step, once the chained decode has settled)."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.crc = 0
        self.steps = 0
        self._compared = 0

    def add(self, rids: list[int], tokens: list[int]) -> None:
        self.crc = zlib.crc32(repr((rids, tokens)).encode(), self.crc)
        self.steps += 1

    @property
    def due(self) -> bool:
        return self.steps - self._compared >= DIGEST_STEPS

    def compare(self) -> None:
        self._compared = self.steps
        mine = mx.array([self.crc & 0x7FFFFFFF], mx.int32)
        low = mx.distributed.all_min(mine, group=self.group)
        high = mx.distributed.all_max(mine, group=self.group)
        if low.item() != high.item():
            raise GroupBroken(f"the ranks sampled different tokens (digests {low.item()} "
                              f"and {high.item()} after {self.steps} steps)")


class Watchdog:
    """Ends the process when a step runs past `seconds`: a rank stuck in a collective
    (a peer stopped or unreachable) would otherwise wait forever, and the launcher
    restarts the group once a rank is gone."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._started: float | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def begin(self) -> None:
        with self._lock:
            self._started = time.monotonic()

    def end(self) -> None:
        with self._lock:
            self._started = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.5, self.seconds / 4))
            with self._lock:
                started = self._started
            if started is not None and time.monotonic() - started > self.seconds:
                _end_rank(f"a step has run for more than {self.seconds:.0f} s "
                          "(--worker-timeout): a rank of the group is stuck; this rank "
                          "exits so that the group is restarted")
