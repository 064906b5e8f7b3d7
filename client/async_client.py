"""AsyncClient: many requests in flight over one DEALER socket.

One reader task routes every reply to its request's queue by rid. A request
never waits forever: if nothing arrives for `timeout` seconds, or the server's
connection drops, it fails with MlxdError.
"""

import asyncio
import logging
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from mlxd.protocol import (
    AbortRequest, Decoder, ErrorReply, GenerateRequest, ProtocolError, StatsReply,
    StatsRequest, StreamChunk, encode,
)
from mlxd.runtime.aio import LoopSocket

from .types import Chunk, MlxdError, Result

log = logging.getLogger("mlxd.client")


class AsyncStream:
    """Async iterator of Chunks for one request; `rid` names it for abort().
    The request is sent when iteration starts (or on `await stream.start()`)."""

    def __init__(self, client: "AsyncClient", request: GenerateRequest):
        self.rid = request.rid
        self._client = client
        self._request = request
        self._queue: asyncio.Queue | None = None
        self._done = False

    async def start(self) -> "AsyncStream":
        if self._queue is None:
            self._queue = await self._client._send(self._request)
        return self

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        try:
            msg = await asyncio.wait_for(self._queue.get(), self._client.timeout)
        except asyncio.TimeoutError:
            self._finish()
            raise MlxdError("timeout", f"no reply for {self._client.timeout} s") from None
        if isinstance(msg, MlxdError):
            self._finish()
            raise msg
        chunk = Chunk.from_message(msg)
        if chunk.finish_reason is not None:
            self._finish()
        return chunk

    def _finish(self) -> None:
        self._done = True
        self._client._queues.pop(self.rid, None)

    async def abort(self) -> None:
        await self._client.abort(self.rid)


class AsyncClient:
    def __init__(self, address: str, timeout: float | None = 600.0):
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context()
        # a plain socket, driven by LoopSocket in the event loop (cheaper per message
        # than zmq.asyncio; see runtime/aio.py); its monitor is a zmq.asyncio socket
        self._sock = zmq.Socket(self._ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._io: LoopSocket | None = None   # made in the event loop, at first use
        self._queues: dict[str, asyncio.Queue] = {}
        self._decoder = Decoder(StreamChunk, ErrorReply, StatsReply)
        self._tasks: list[asyncio.Task] = []

    # ---- public surface ----------------------------------------------------

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       messages: list[dict] | None = None, rid: str | None = None,
                       **params) -> Result:
        stream = AsyncStream(self, _request(prompt, input_ids, messages, rid, params, False))
        result = Result(stream.rid)
        async for chunk in stream:
            result.add(chunk)
        return result

    async def chat(self, messages: list[dict], **params) -> Result:
        return await self.generate(messages=messages, **params)

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               messages: list[dict] | None = None, rid: str | None = None,
               **params) -> AsyncStream:
        """`async for chunk in client.stream(...)`: the request's output as it is made."""
        return AsyncStream(self, _request(prompt, input_ids, messages, rid, params, True))

    async def abort(self, rid: str) -> None:
        await self._channel().send(encode(AbortRequest(rid)))

    async def stats(self) -> dict:
        """The server's counters: waiting / running requests, free / cached / used KV
        slots, retractions, and the worker's memory and last step timing."""
        rid = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self._channel().send(encode(StatsRequest(rid)))
            msg = await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise MlxdError("timeout", f"no reply for {self.timeout} s") from None
        finally:
            self._queues.pop(rid, None)
        if isinstance(msg, MlxdError):
            raise msg
        return msg.stats

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        if self._io is not None:
            self._io.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ---- internals ---------------------------------------------------------

    async def _send(self, request: GenerateRequest) -> asyncio.Queue:
        channel = self._channel()
        if request.rid in self._queues:
            raise MlxdError("duplicate_rid", f"request id {request.rid!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.rid] = queue
        await channel.send(encode(request))
        return queue

    def _channel(self) -> LoopSocket:
        """The socket, in the running loop, with its reader tasks started."""
        if self._io is None:
            self._io = LoopSocket(self._sock)
            self._tasks = [asyncio.ensure_future(self._read_replies(self._io)),
                           asyncio.ensure_future(self._watch_connection())]
        return self._io

    async def _read_replies(self, channel: LoopSocket) -> None:
        while True:
            frame = await channel.recv()
            try:
                msg = self._decoder.decode(frame)
            except ProtocolError as exc:
                log.error("dropped a malformed reply: %s", exc)
                continue
            if isinstance(msg, ErrorReply):
                if msg.rid is None:
                    log.error("server rejected a frame: %s: %s", msg.code, msg.message)
                    continue
                rid, msg = msg.rid, MlxdError(msg.code, msg.message)
            else:
                rid = msg.rid
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(msg)

    async def _watch_connection(self) -> None:
        connected = False
        while True:
            event = await recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                connected = False
                self._fail_all(MlxdError("disconnected", f"lost the connection to {self.address}"))

    def _fail_all(self, error: MlxdError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)


def _request(prompt, input_ids, messages, rid, params, stream) -> GenerateRequest:
    return GenerateRequest(rid or uuid.uuid4().hex, prompt, messages, input_ids, params, stream)
