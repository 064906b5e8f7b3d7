"""The ZeroMQ context and sockets behind a client, and their release.

A client may be dropped without close(): a finalizer then releases these from
whatever thread the garbage collector runs in, at any moment. Nothing here may block
that thread, so every socket has LINGER 0 (close() alone asks for more) and is made by
the context (pyzmq's Context.destroy closes only those, and term() waits forever for
any still open); what belongs to the event loop is handed to it while it runs.
"""

import asyncio
import warnings

import zmq

from mlxd.runtime.aio import LoopSocket, TaskSet
from mlxd.runtime.keys import connect_with_curve

from .connection import EVENTS


class Transport:
    """A DEALER connected to `address` (CURVE with `server_key`) and the PAIR receiving
    its monitor's EVENTS. `attach()` wraps both for the running loop, where `tasks`
    run; `close()` or `close_soon()` releases everything, once."""

    def __init__(self, address: str, server_key: bytes | None):
        self.tasks = TaskSet()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._watched: list[LoopSocket] = []   # [monitor, dealer], once attached
        self.closing = False   # close() or close_soon() was called
        self._closed = False
        self.ctx = zmq.Context()
        self.dealer = self._socket(zmq.DEALER)
        self.monitor = self._socket(zmq.PAIR)
        try:
            if server_key is not None:
                connect_with_curve(self.dealer, server_key)
            monitor_address = f"inproc://mlxd-client-monitor.{id(self)}"
            self.dealer.monitor(monitor_address, EVENTS)
            self.monitor.connect(monitor_address)
            self.dealer.connect(address)
        except BaseException:
            self.close()
            raise

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def attach(self) -> tuple[LoopSocket, LoopSocket]:
        """The DEALER and the monitor as LoopSockets of the running loop."""
        self.loop = asyncio.get_running_loop()
        self._watched = [LoopSocket(self.monitor, multipart=True), LoopSocket(self.dealer)]
        return self._watched[1], self._watched[0]

    def close(self, linger: int = 0) -> None:
        """Release now, letting the DEALER's queued frames leave for up to `linger` ms.
        Call it in the loop's thread, or where no loop runs."""
        self.closing = True
        if self._closed:
            return
        self._closed = True
        monitor, dealer = self.monitor, self.dealer
        # cancelling a task or a waiter of a closed loop raises; its own have ended
        if self.loop is not None and not self.loop.is_closed():
            self.tasks.cancel()
            monitor, dealer = self._watched   # the same sockets, unwatched as they close
        self.dealer.disable_monitor()
        monitor.close(linger=0)
        dealer.close(linger=linger)
        self.ctx.term()

    def close_soon(self) -> None:
        """close() from any thread, never waiting: in the loop while it runs (the
        collector may have stopped it in the middle of a socket operation)."""
        self.closing = True
        if self.loop is not None and self.loop.is_running():
            try:
                self.loop.call_soon_threadsafe(self.close)
                return
            except RuntimeError:   # closed meanwhile: nothing runs there any more
                pass
        self.close()


def release_dropped(kind: str, address: str, transport: Transport, depth: int = 0) -> None:
    """A client's finalizer (called `depth` calls deep): say it was never closed, and
    release its transport. The warning names the line that dropped the client, or
    where the collector ran."""
    if not transport.closing:
        warnings.warn(f"unclosed mlxd {kind} to {address}: call close() or use `with`",
                      ResourceWarning, stacklevel=3 + depth)   # past weakref.finalize
    transport.close_soon()
