"""A ZeroMQ socket for an asyncio loop, cheaper per message than `zmq.asyncio`.

`zmq.asyncio` starts and stops watching the socket around every receive and
wraps each one in futures and event-flag checks; `bench/socket_cpu.py` compares
the CPU per received message of both and of a plain blocking receive. On a
machine whose cores the worker already fills, that CPU comes out of the decode. `LoopSocket` watches the socket's file descriptor once, for its
whole life, and each wakeup drains every queued frame.

ZeroMQ's descriptor signals that the socket's events *may* have changed, and any
operation on the socket (a send, a failed send, reading its events) can consume
that signal: so after every wakeup and every operation the socket's events are
read again until it reports no frame waiting, and whoever can go on is woken.
"""

import asyncio
import functools
from collections import deque

import zmq


class TaskSet:
    """Tasks started and not awaited: the event loop keeps only weak references to
    tasks, so they are held here until they end."""

    def __init__(self):
        self._tasks: set[asyncio.Future] = set()

    def spawn(self, work) -> asyncio.Future:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class LoopSocket:
    """Wraps a plain (not `zmq.asyncio`) socket; use it from one event loop only, with
    one coroutine receiving (any number may send). `close()` cancels every waiter.
    With `max_queued`, at most that many frames are taken off the socket ahead of the
    receiver: the rest wait in ZeroMQ, which takes them from its peers in turn (a
    ROUTER fair-queues) and holds back a peer that sends faster than it is served."""

    def __init__(self, sock: zmq.Socket, multipart: bool = False,
                 max_queued: int | None = None, copy: bool = True):
        self.sock = sock
        self._max_queued = max_queued
        recv = sock.recv_multipart if multipart else sock.recv
        # copy=False: zmq.Frame objects, which carry the frame's properties (ZMQ_SRCFD)
        self._recv = recv if copy else functools.partial(recv, copy=False)
        self._receives = sock.type not in (zmq.PUSH, zmq.PUB)
        self._frames: deque = deque()
        self._readable: asyncio.Future | None = None
        self._writable: list[asyncio.Future] = []   # senders waiting at the high-water mark
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._on_event)

    async def recv(self):
        """The next frame (a list of frames with `multipart`)."""
        if not self._receives:
            raise TypeError(f"a {self.sock.type.name} socket does not receive")
        while not self._frames:
            self._service()
            if self._frames:
                break
            self._readable = self._loop.create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        return self._frames.popleft()

    def recv_nowait(self):
        """The next frame if one is waiting, else None. Reading the socket directly
        instead could consume the descriptor's signal and leave `recv` asleep."""
        if not self._frames:
            self._service()
        return self._frames.popleft() if self._frames else None

    async def send(self, frame: bytes) -> None:
        await self._send(self.sock.send, frame)

    async def send_multipart(self, frames: list[bytes]) -> None:
        await self._send(self.sock.send_multipart, frames)

    def try_send_multipart(self, frames: list[bytes]) -> bool:
        """Send without waiting; False (nothing sent) where the peer's queue is full
        (a ROUTER with ZMQ_ROUTER_MANDATORY says so instead of dropping)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        finally:
            self._service()

    def close(self, linger: int | None = None) -> None:
        self._stop_watching()
        if not self.sock.closed:
            self.sock.close(linger)

    # ---- internals ----------------------------------------------------------

    async def _send(self, send, data) -> None:
        while True:
            try:
                send(data, zmq.NOBLOCK)
                break
            except zmq.Again:   # at the high-water mark: wait until it can take more
                waiter = self._loop.create_future()
                self._writable.append(waiter)
                try:
                    if not self._service() & zmq.POLLOUT:
                        await waiter
                finally:
                    self._writable.remove(waiter)
        self._service()

    def _on_event(self) -> None:
        try:
            self._service()
        except zmq.ZMQError:   # the socket or its context is gone: nothing more comes
            self._stop_watching()

    def _service(self) -> int:
        """After any operation on the socket (each may consume the descriptor's
        signal): receive every queued frame until the socket reports none, wake the
        receiver if there are frames and the senders if it can take more. The
        socket's last events."""
        if self.sock.closed:
            return 0
        events = self.sock.getsockopt(zmq.EVENTS)
        while self._receives and events & zmq.POLLIN and not self._full():
            self._frames.append(self._recv(zmq.NOBLOCK))
            events = self.sock.getsockopt(zmq.EVENTS)
        if self._frames and self._readable is not None:
            _wake(self._readable)
        if events & zmq.POLLOUT:
            for waiter in self._writable:
                _wake(waiter)
        return events

    def _full(self) -> bool:
        return self._max_queued is not None and len(self._frames) >= self._max_queued

    def _stop_watching(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        for waiter in [self._readable, *self._writable]:
            if waiter is not None and not waiter.done():
                waiter.cancel()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
