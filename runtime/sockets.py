"""ZeroMQ socket helpers. Rule: a process binds the sockets it receives on."""

import logging
from typing import Callable

import zmq

from mlxd.protocol import Decoder, ProtocolError
from mlxd.protocol.codec import MAX_FRAME_BYTES
from mlxd.runtime.lifecycle import drain


def bind_pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def connect_push(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


HEARTBEAT_MS = 1000          # ZeroMQ PING interval on a link between machines
HEARTBEAT_TIMEOUT_MS = 4000  # no traffic for this long: the peer is gone


def heartbeat(sock: zmq.Socket, timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> None:
    """ZeroMQ's own heartbeats (both ends of a tcp link set them): a peer whose machine
    vanished is disconnected within `timeout_ms` even while nothing is sent. The peer's
    ZeroMQ I/O thread answers them, so a peer that is stopped (SIGSTOP) or wedged
    whole is disconnected too, but not one whose own loop is merely busy."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, min(HEARTBEAT_MS, timeout_ms // 2))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)


CURVE_FRAME_BYTES = 33   # CURVE sends a frame as a MESSAGE command this much longer
INT_BYTES = 9            # msgpack's widest integer
IDS_PER_POSITION = 6     # a Step's ids per context position of one request (5, and room)
REQUEST_BYTES = 4 << 20  # a request's sampling parameters (a grammar: the least client cap)


def max_step_bytes(max_context: int, max_running_requests: int) -> int:
    """The biggest Step a scheduler sends a group's rank: every running request's
    prefill of its whole context (per position its input, slot and window ids, or its
    prefix's slot and window ids, and its penalty history: IDS_PER_POSITION ids at
    INT_BYTES) with its sampling parameters. A group has no disk tier: no spills."""
    per_request = IDS_PER_POSITION * INT_BYTES * max_context + REQUEST_BYTES
    return max_running_requests * per_request


def cap_frames(sock: zmq.Socket, max_bytes: int) -> int:
    """Have ZeroMQ drop the connection of a peer whose frame is over `max_bytes` (or
    MAX_FRAME_BYTES, which every Decoder refuses) once its size is read, before any of
    it is buffered: a handshake's frames too, so a peer without the key cannot make us
    buffer a bigger one. Call before bind (a listener keeps the options it had then)."""
    cap = min(max_bytes, MAX_FRAME_BYTES) + CURVE_FRAME_BYTES
    sock.setsockopt(zmq.MAXMSGSIZE, cap)
    return cap


def monitor_pair(ctx: zmq.Context, sock: zmq.Socket, events: int) -> zmq.Socket:
    """A plain PAIR socket receiving `sock`'s monitor events (get_monitor_socket would
    make one of the context's class: a zmq.asyncio socket in an asyncio context)."""
    address = f"inproc://monitor.{id(sock)}"
    sock.monitor(address, events)
    pair = zmq.Socket(ctx, zmq.PAIR)
    pair.connect(address)
    return pair


def close_all(ctx: zmq.Context, *sockets: zmq.Socket) -> None:
    """Close sockets before the context, never leaving a blocked term()."""
    for sock in sockets:
        if sock is not None:
            sock.close(linger=0)
    ctx.term()


def waking_receiver(sock: zmq.Socket, wakeup) -> Callable[[], bytes]:
    """A blocking `recv()` for `sock` that also wakes when a signal arrives (see
    runtime.lifecycle.install_signal_handlers), so the signal's handler runs."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wakeup, zmq.POLLIN)

    def recv() -> bytes:
        while True:
            events = dict(poller.poll())
            if sock in events:
                return sock.recv()
            drain(wakeup)

    return recv


def decode_from(decoder: Decoder, frame: bytes, sender: str, log: logging.Logger):
    """An internal peer's frame as a message, or None (logged) when it is malformed:
    a bad frame is dropped, never fatal."""
    try:
        return decoder.decode(frame)
    except ProtocolError as exc:
        log.error("dropped a malformed frame from the %s: %s", sender, exc)
        return None
