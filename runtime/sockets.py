"""ZeroMQ socket helpers. Rule: a process binds the sockets it receives on."""

import logging
from typing import Callable

import zmq

from mlxd.protocol import Decoder, ProtocolError
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


def heartbeat(sock: zmq.Socket) -> None:
    """ZeroMQ's own heartbeats (both ends of a tcp link set them): a peer whose machine
    vanished is disconnected within HEARTBEAT_TIMEOUT_MS even while nothing is sent."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


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
