"""Client: the blocking SDK. It runs an AsyncClient on a private event-loop thread,
so one Client can be shared by many threads. A Client dropped without close() warns
(ResourceWarning), releases its sockets and ends its thread, waiting for neither."""

import asyncio
import threading
import weakref

from .async_client import AsyncClient, AsyncStream
from .transport import Transport, release_dropped
from .types import Chunk, MlxdError, Result


class Stream:
    """Iterator of Chunks for one request; `rid` names it for abort(). Closing it
    (`close()`, leaving `with stream:`) or dropping it before its finish chunk (as
    breaking out of `for chunk in client.stream(...)` does) aborts the request."""

    def __init__(self, client: "Client", inner: AsyncStream):
        self.rid = inner.rid
        self._client = client
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        try:
            return self._client._call(self._inner.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def abort(self) -> None:
        self._client.abort(self.rid)

    def close(self) -> None:
        if not self._client.closed:
            self._client._call(self._inner.aclose())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    def __init__(self, address: str, timeout: float | None = 600.0, *,
                 server_key: str | bytes | None = None, api_key: str | None = None,
                 model: str | None = None):
        """See AsyncClient for `server_key`, `api_key` and `model`."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve, args=(self._loop,), name="mlxd-client",
                                        daemon=True)
        self._thread.start()
        try:
            self._inner: AsyncClient = self._call(
                _make(address, timeout, server_key, api_key, model))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise
        # holds what it releases, never the Client (or it would never be dropped)
        self._finalizer = weakref.finalize(self, _release_dropped, address, self._loop,
                                           self._inner._transport)

    def _call(self, coro):
        if self._loop.is_closed():
            coro.close()
            raise MlxdError("closed", "the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt: str | None = None, **kwargs) -> Result | list[Result]:
        return self._call(self._inner.generate(prompt, **kwargs))

    def chat(self, messages: list[dict], **params) -> Result | list[Result]:
        return self._call(self._inner.chat(messages, **params))

    def stream(self, prompt: str | None = None, **kwargs) -> Stream:
        inner = self._inner.stream(prompt, **kwargs)
        self._call(inner.start())
        return Stream(self, inner)

    def abort(self, rid: str) -> None:
        self._call(self._inner.abort(rid))

    def stats(self, model: str | None = None) -> dict:
        return self._call(self._inner.stats(model))

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def close(self) -> None:
        """Abort every request still in flight and release the socket."""
        if self._loop.is_closed():
            return
        self._finalizer.detach()
        self._call(self._inner.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The client's thread: run `loop` until stopped, then close it."""
    try:
        loop.run_forever()
        loop.run_until_complete(_finish_calls(1.0))
    finally:
        loop.close()


def _release_dropped(address: str, loop: asyncio.AbstractEventLoop,
                     transport: Transport) -> None:
    """A dropped Client's finalizer: release its transport and stop its loop, in the
    loop's thread; the thread then ends on its own (joining it here could deadlock)."""
    release_dropped("Client", address, transport, depth=1)
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:   # already closed
        pass


async def _finish_calls(grace: float) -> None:
    """Let the calls that close() failed return their error to their threads, and
    cancel any still waiting after `grace` s, so that no thread waits forever."""
    pending = asyncio.all_tasks() - {asyncio.current_task()}
    if pending:
        _, late = await asyncio.wait(pending, timeout=grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


async def _make(address: str, timeout: float | None, server_key, api_key,
                model) -> AsyncClient:
    return AsyncClient(address, timeout, server_key=server_key, api_key=api_key, model=model)
