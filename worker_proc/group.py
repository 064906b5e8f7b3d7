"""One rank of a tensor-parallel worker group (`--tp N`) over mx.distributed.

Every rank receives every Step and runs it alike (the same model split, the same
seeds: sampling is identical on all ranks); rank 0 alone replies. The ranks meet only
inside the model's collectives (mlx_lm's `shard()` puts an all_sum after each
attention and MLP), plus the few this module adds: agreeing on the KV budget at
start (the group's capacity is its smallest rank's) and comparing a digest of the
sampled tokens every DIGEST_STEPS steps, so that ranks that diverge are an error, not
silent. A group cannot be formed again inside a process: whatever breaks it (a peer
lost, a step past the deadline, a digest mismatch) ends the rank, and the launcher
restarts the whole group.
"""

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
from mlxd.runtime.sockets import heartbeat

log = logging.getLogger("mlxd.worker")

DIGEST_STEPS = 16   # steps between digest comparisons
GROUP_EXIT_CODE = 3
ZAP_DOMAIN = "mlxd-ranks"


class GroupBroken(RuntimeError):
    """The group cannot go on (ranks diverged); the rank exits and is restarted."""


def form_group(ranks: int) -> mx.distributed.Group:
    """Join the ring described by MLX_RANK / MLX_HOSTFILE (the launcher sets them)."""
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != ranks:
        raise GroupBroken(f"the ring has {group.size()} ranks, not {ranks}")
    log.info("rank %d of %d joined the ring", group.rank(), group.size())
    return group


def load_sharded(path: str, group: mx.distributed.Group):
    """(model, tokenizer): the weights loaded lazily, split with mlx_lm's `shard()`,
    then read: each rank reads only its part of the layers."""
    from mlx_lm import load

    model, tokenizer = load(path, lazy=True)
    if not hasattr(model, "shard"):
        raise GroupBroken(f"the model at {path} has no tensor-parallel split")
    model.shard(group)
    mx.eval(model.parameters())
    return model, tokenizer


def agree(group: mx.distributed.Group, budget, settings: int):
    """The KV budget every rank can hold: each figure the group's smallest; first,
    every rank must run with the same `settings` (a digest: see the worker's
    `settings_digest`), or the group refuses to start."""
    digest = mx.array([settings], mx.int64)
    low, high = (mx.distributed.all_min(digest, group=group).item(),
                 mx.distributed.all_max(digest, group=group).item())
    if low != high:
        raise GroupBroken("the ranks of the group run with different settings (model "
                          "config, --decode-layout, --max-running-requests, "
                          "--max-prefill-tokens or --window-capacity): start every rank "
                          "with the same")
    figures = mx.array([budget.capacity, budget.decode_cache_tokens,
                        budget.window_capacity], mx.int64)
    capacity, cache, window = (int(x) for x in mx.distributed.all_min(figures, group=group)
                               .tolist())
    return replace(budget, capacity=capacity, decode_cache_tokens=cache,
                   window_capacity=window)


def bind_remote_steps(ctx: zmq.Context, address: str, key_file: str):
    """(the Step socket of a rank on another machine, its authenticator): a CURVE
    server under the server's key pair, admitting that pair's key only (the
    scheduler's), with heartbeats."""
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
    sock.bind(address)
    return sock, auth


def exit_when_scheduler_leaves(steps_in: zmq.Socket) -> None:
    """A rank ends when the scheduler's connection to it ends: the scheduler reopens
    its links when the group broke (a rank died), and a rank idle in its receive would
    otherwise never notice that its ring is gone; its end has the launcher (rank 0,
    or every rank here) or `mlxd rank` start the next group."""
    monitor = steps_in.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def watch():
        event = parse_monitor_message(monitor.recv_multipart())
        _end_rank(f"the scheduler's connection ended (event {event['event']}): the "
                  "group is being restarted; this rank exits")

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
