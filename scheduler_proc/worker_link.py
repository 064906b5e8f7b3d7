"""The scheduler's Step socket to the worker, watched for the worker's death.

The worker binds the socket's ipc address; when its process dies (SIGKILL, crash,
out of memory) the kernel closes that end and the socket's monitor reports
EVENT_DISCONNECTED at once. This needs no message from anyone, so the scheduler
notices however the worker went, and a hung (SIGSTOP'd) worker is not mistaken for
a dead one: that is the watchdog's case (--worker-timeout).
"""

import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.protocol import WorkerLimits
from mlxd.runtime.sockets import connect_push


class WorkerLink:
    """`sock` sends Steps; `monitor` is readable when the worker's end went away
    (poll it, then call `lost()`)."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.ctx, self.address = ctx, address
        self._open()

    def _open(self) -> None:
        self.sock = connect_push(self.ctx, self.address)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.monitor.setsockopt(zmq.LINGER, 0)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def lost(self) -> bool:
        """Whether the worker's end of the socket went away since the last call."""
        lost = False
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return lost
            lost |= event["event"] == zmq.EVENT_DISCONNECTED

    def reopen(self) -> None:
        """A fresh socket for the next worker: a Step still queued for the dead one
        must never reach its successor."""
        self.close()
        self._open()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


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
