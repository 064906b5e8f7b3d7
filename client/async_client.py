"""AsyncClient: many requests in flight over one DEALER socket.

One reader task routes every reply to its request's queue by rid. A request
never waits forever: if nothing arrives for `timeout` seconds, the server's
connection drops, or no connection exists, it fails with MlxdError. A request
the client abandons (timed out, stream dropped or closed early, client closed)
is aborted on the server, which would otherwise run it on for nobody. A client
dropped without close() warns (ResourceWarning) and releases its sockets
(transport.py); its reader tasks do not hold it, so that it can be dropped.
"""

import asyncio
import functools
import logging
import os
import uuid
import weakref

import zmq

from mlxd.protocol import (
    AbortRequest, Decoder, ErrorReply, GenerateRequest, ProtocolError, StatsReply,
    StatsRequest, StreamChunk, encode,
)
from mlxd.runtime.aio import LoopSocket
from mlxd.runtime.keys import BadKey, server_key_for

from .connection import Connection
from .transport import Transport, release_dropped
from .types import Chunk, MlxdError, Result

log = logging.getLogger("mlxd.client")

CONNECT_GRACE_S = 1.5    # how long a call waits for a connection before "unavailable"
ABORT_LINGER_MS = 500    # how long close() lets its aborts leave


class AsyncStream:
    """Async iterator of Chunks for one request; `rid` names it for abort().
    The request is sent when iteration starts (or on `await stream.start()`).
    Closing it (`aclose()`) or dropping it before its finish chunk aborts it.
    A request with n > 1 choices streams all of them, each chunk with its
    `index`, and ends after every choice's finish chunk."""

    def __init__(self, client: "AsyncClient", request: GenerateRequest):
        self.rid = request.rid
        self._client = client
        self._request = request
        self._queue: asyncio.Queue | None = None
        self._done = False
        self._unfinished = _choices(request.params)   # choices without a finish chunk

    async def start(self) -> "AsyncStream":
        if self._queue is None and not self._done:
            try:
                self._queue = await self._client._send(self._request)
            except BaseException:
                self._done = True
                raise
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
            await self._client._abort_quietly(self.rid)
            raise MlxdError("timeout", f"no reply for {self._client.timeout} s") from None
        if isinstance(msg, MlxdError):
            self._finish()
            raise msg
        chunk = Chunk.from_message(msg)
        if chunk.finish_reason is not None:
            self._unfinished -= 1
            if self._unfinished <= 0:
                self._finish()
        return chunk

    def _finish(self) -> None:
        self._done = True
        self._client._queues.pop(self.rid, None)

    async def abort(self) -> None:
        await self._client.abort(self.rid)

    async def aclose(self) -> None:
        """Stop reading; a request still running is aborted."""
        if self._queue is not None and not self._done:
            self._finish()
            await self._client._abort_quietly(self.rid)
        self._done = True

    def _abandon(self) -> None:
        if self._queue is not None and not self._done:
            self._done = True
            self._client._abandon(self.rid)

    def __del__(self):
        self._abandon()


class AsyncClient:
    """`server_key`: the server's CURVE public key; by default MLXD_SERVER_KEY, or for
    a loopback address the key the local server published (runtime/keys.py).
    `api_key`: the server's `--api-key`, by default MLXD_API_KEY. `model`: the served
    model requests ask for unless they name one (`model=`); by default the server's
    first."""

    def __init__(self, address: str, timeout: float | None = 600.0, *,
                 server_key: str | bytes | None = None, api_key: str | None = None,
                 model: str | None = None):
        self.address = address
        self.timeout = timeout
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("MLXD_API_KEY", "")
        try:
            key = server_key_for(address, server_key)
        except BadKey as exc:
            raise MlxdError("invalid_request", f"server_key: {exc}") from None
        # plain sockets, driven by LoopSocket in the event loop (cheaper per message
        # than zmq.asyncio; see runtime/aio.py)
        self._transport = Transport(address, key)
        self._encrypted = key is not None
        self._io: LoopSocket | None = None   # made in the event loop, at first use
        self._connection: Connection | None = None
        self._queues: dict[str, asyncio.Queue] = {}   # rid -> its replies, while in flight
        self._decoder = Decoder(StreamChunk, ErrorReply, StatsReply)
        self._closed = False
        self._finalizer = weakref.finalize(self, release_dropped, "AsyncClient", address,
                                           self._transport)

    # ---- public surface ----------------------------------------------------

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       messages: list[dict] | None = None, rid: str | None = None,
                       model: str | None = None, **params) -> Result | list[Result]:
        """Run one request to its end, on `model` (a served model's name or alias; by
        default the client's). `params` use OpenAI's names (each declared in
        protocol/sampling.py): max_tokens,
        temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
        skip_special_tokens (default true: special tokens' text is left out), logprobs, top_logprobs, timeout, presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias ({token id: bias}), min_tokens, n,
        response_format (OpenAI's `{"type": "json_object"}` or `{"type": "json_schema",
        "json_schema": {"name", "schema", "strict"}}`, `{"type": "json_object", "schema"}`,
        or `{"type": "regex", "regex"}`,
        `{"type": "grammar", "grammar": <Lark>}`); with `messages`, also tools,
        tool_choice, parallel_tool_calls, chat_template_kwargs and enable_thinking
        (OpenAI's shapes; tool calls come parsed in the Result's `tool_calls`, thinking
        in its `reasoning`); the server rejects any other name and any value out of
        range or constraint that does not compile (`invalid_request`, the MlxdError's
        `param` naming it).
        With n > 1, the n choices' Results, in `index` order."""
        request = self._request(prompt, input_ids, messages, rid, params, False, model)
        stream = AsyncStream(self, request)
        n = _choices(params)
        results = [Result(stream.rid, index=i) for i in range(n)]
        try:
            async for chunk in stream:
                results[chunk.index].add(chunk)
        finally:
            stream._abandon()   # cancelled while waiting: abort it on the server
        return results if n > 1 else results[0]

    async def chat(self, messages: list[dict], **params) -> Result | list[Result]:
        return await self.generate(messages=messages, **params)

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               messages: list[dict] | None = None, rid: str | None = None,
               model: str | None = None, **params) -> AsyncStream:
        """`async for chunk in client.stream(...)`: the request's output as it is made."""
        return AsyncStream(self, self._request(prompt, input_ids, messages, rid, params,
                                               True, model))

    async def abort(self, rid: str) -> None:
        await self._channel().send(encode(AbortRequest(rid, self.api_key)))

    async def stats(self, model: str | None = None) -> dict:
        """The server's counters for `model` (by default the client's): waiting /
        running requests, free / cached / used KV slots, retractions, and the worker's
        memory and last step timing."""
        rid = uuid.uuid4().hex
        queue = await self._register(rid, encode(StatsRequest(rid, self.api_key,
                                                              model or self.model)))
        try:
            msg = await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise MlxdError("timeout", f"no reply for {self.timeout} s") from None
        finally:
            self._queues.pop(rid, None)
        if isinstance(msg, MlxdError):
            raise msg
        return msg.stats

    async def close(self) -> None:
        """Abort every request still in flight (their callers get MlxdError("closed")),
        let the aborts leave for up to ABORT_LINGER_MS, and release the socket."""
        if self._closed:
            return
        await asyncio.sleep(0)   # aborts of streams dropped just before go out first
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._transport.close(linger=self._abort_in_flight())

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ---- internals ---------------------------------------------------------

    def _request(self, prompt, input_ids, messages, rid, params, stream,
                 model) -> GenerateRequest:
        return GenerateRequest(rid or uuid.uuid4().hex, prompt, messages, input_ids, params,
                               stream, self.api_key, model or self.model)

    async def _send(self, request: GenerateRequest) -> asyncio.Queue:
        return await self._register(request.rid, _encode_request(request))

    async def _register(self, rid: str, frame: bytes) -> asyncio.Queue:
        """Send `frame` once connected; the queue its replies go to until popped."""
        channel = self._channel()
        await self._connection.ready(CONNECT_GRACE_S)
        if rid in self._queues:
            raise MlxdError("duplicate_rid", f"request id {rid!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await channel.send(frame)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        return queue

    def _channel(self) -> LoopSocket:
        """The socket, in the running loop, with its reader tasks started."""
        if self._closed:
            raise MlxdError("closed", "the client is closed")
        if self._io is None:
            self._io, events = self._transport.attach()
            # the tasks get the parts they use, never the client (see the module's doc)
            self._connection = Connection(events, self.address,
                                          functools.partial(_fail_all, self._queues),
                                          self._encrypted)
            self._transport.tasks.spawn(_read_replies(self._io, self._decoder, self._queues))
            self._transport.tasks.spawn(self._connection.watch())
        return self._io

    def _fail_all(self, error: MlxdError) -> None:
        _fail_all(self._queues, error)

    async def _abort_quietly(self, rid: str) -> None:
        if not self._closed:
            await self.abort(rid)

    def _abandon(self, rid: str) -> None:
        """Forget `rid` and abort it on the server. Safe from any thread, since a
        stream's finaliser runs wherever its last reference goes."""
        loop = self._transport.loop
        if loop is None or self._closed:
            return
        try:
            loop.call_soon_threadsafe(self._abort_abandoned, rid)
        except RuntimeError:   # the loop is closed: so is the client
            pass

    def _abort_abandoned(self, rid: str) -> None:
        if not self._closed and self._queues.pop(rid, None) is not None:
            self._transport.tasks.spawn(self._abort_quietly(rid))

    def _abort_in_flight(self) -> int:
        """Queue an abort for each request in flight and fail its caller; the linger
        (ms) that lets the aborts leave."""
        if not self._queues:
            return 0
        for rid in self._queues:
            frame = encode(AbortRequest(rid, self.api_key))
            try:   # never block while closing: at the high-water mark, drop the abort
                self._transport.dealer.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                break
        self._fail_all(MlxdError("closed", "the client was closed"))
        self._queues.clear()
        return ABORT_LINGER_MS if self._connection is not None and self._connection.up else 0


async def _read_replies(channel: LoopSocket, decoder: Decoder,
                        queues: dict[str, asyncio.Queue]) -> None:
    """Route every reply to its request's queue, by rid."""
    while True:
        frame = await channel.recv()
        try:
            msg = decoder.decode(frame)
        except ProtocolError as exc:
            log.error("dropped a malformed reply: %s", exc)
            continue
        if isinstance(msg, ErrorReply):
            if msg.rid is None:
                log.error("server rejected a frame: %s: %s", msg.code, msg.message)
                continue
            rid, msg = msg.rid, MlxdError(msg.code, msg.message, msg.param)
        else:
            rid = msg.rid
        queue = queues.get(rid)
        if queue is not None:
            queue.put_nowait(msg)


def _fail_all(queues: dict[str, asyncio.Queue], error: MlxdError) -> None:
    for queue in queues.values():
        queue.put_nowait(error)


def _choices(params: dict) -> int:
    """How many choices a request's `params` ask for (the server checks the value)."""
    n = params.get("n", 1)
    return n if type(n) is int and n > 1 else 1


def _encode_request(request: GenerateRequest) -> bytes:
    try:
        return encode(request)
    except (TypeError, ValueError, OverflowError) as exc:   # what msgpack raises
        raise MlxdError("invalid_request",
                        f"request {request.rid!r} cannot be encoded: {exc}") from None

