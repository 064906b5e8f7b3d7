"""The scheduler's Step socket to the worker, watched for the worker's death.

The worker binds the socket's ipc address; when its process dies (SIGKILL, crash,
out of memory) the kernel closes that end and the socket's monitor reports
EVENT_DISCONNECTED at once. This needs no message from anyone, so the scheduler
notices however the worker went, and a hung (SIGSTOP'd) worker is not mistaken for
a dead one: that is the watchdog's case (--worker-timeout).

A tensor-parallel worker group (`ranks` > 1) is one worker to the scheduler: every
Step goes to every rank (each binds its own address, runtime/worker_group.py), and
any rank's end counts as the worker's death (the launcher restarts the group).
"""

import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.protocol import WorkerLimits
from mlxd.runtime.keys import KeyPair, connect_as_owner
from mlxd.runtime.sockets import cap_frames, connect_push, heartbeat
from mlxd.runtime.worker_group import rank_input_addr

COMMAND_BYTES = 1 << 16   # a rank sends its Step socket's peer ZeroMQ's own commands only


class WorkerLink:
    """`send` sends a Step to every rank; each of `monitors` is readable when a rank's
    end went away (poll them, then call `lost()`)."""

    def __init__(self, ctx: zmq.Context, address: str, ranks: int = 1,
                 remote: list[str] = (), curve: KeyPair | None = None):
        """`remote`: the tcp addresses of ranks 1.. on other machines (`--hostfile`),
        reached with the server's key pair `curve`; else every rank is local."""
        self.ctx, self.address, self.ranks = ctx, address, ranks
        self.remote, self.curve = list(remote), curve
        self._open()

    def _open(self) -> None:
        addresses = [self.address] + self.remote if self.remote else \
            [rank_input_addr(self.address, rank) for rank in range(self.ranks)]
        self.socks = [self._connect(address) for address in addresses]
        self.monitors = [sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                         for sock in self.socks]
        for monitor in self.monitors:
            monitor.setsockopt(zmq.LINGER, 0)

    def _connect(self, address: str) -> zmq.Socket:
        if not address.startswith("tcp://"):
            return connect_push(self.ctx, address)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            connect_as_owner(sock, self.curve)
        heartbeat(sock)   # a rank whose machine vanished ends its link within seconds
        cap_frames(sock, COMMAND_BYTES)   # whoever holds its port buffers us nothing
        sock.connect(address)
        return sock

    def send(self, frame: bytes) -> None:
        for sock in self.socks:
            sock.send(frame)

    def lost(self) -> bool:
        """Whether a rank's end of its socket went away since the last call."""
        lost = False
        for monitor in self.monitors:
            while True:
                try:
                    event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                lost |= event["event"] == zmq.EVENT_DISCONNECTED
        return lost

    def reopen(self) -> None:
        """A fresh socket for the next worker: a Step still queued for the dead one
        must never reach its successor."""
        self.close()
        self._open()

    def close(self) -> None:
        for sock, monitor in zip(self.socks, self.monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)


def replacement_mismatch(first: WorkerLimits, new: WorkerLimits) -> str | None:
    """Why a restarted worker cannot take the place of the `first` one, whose limits
    the scheduler and the tokenizer keep using; None when it can (its pool and decode
    caches are at least as large, for the same model)."""
    if new.vocab_size != first.vocab_size or new.max_context != first.max_context:
        return (f"the new worker serves another model (vocabulary {new.vocab_size}, "
                f"context {new.max_context}; was {first.vocab_size}, {first.max_context})")
    if new.kv_capacity < first.kv_capacity or \
            new.decode_cache_tokens < first.decode_cache_tokens:
        return (f"the new worker's KV pool is smaller ({new.kv_capacity} slots, decode "
                f"caches {new.decode_cache_tokens}; was {first.kv_capacity}, "
                f"{first.decode_cache_tokens})")
    return None
