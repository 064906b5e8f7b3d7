"""One HTTP request's generations in the tokenizer's core.

Each `Call` is a client key of its own (so the core keeps its rids apart from every
other client's) and an asyncio queue its sink puts replies on: the sink never blocks,
as the core requires. A call ends by `close()`, which aborts whatever still runs, and
a client that disconnects is noticed by `watch` and closes its call at once, streamed
or not."""

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING, Protocol

from mlxd.protocol import ErrorReply, GenerateRequest, StatsReply, StreamChunk

from .errors import ApiError

if TYPE_CHECKING:
    from ..core import ToScheduler, TokenizerCore

STATS_TIMEOUT = 5.0   # seconds to wait for the scheduler's counters


class Front(Protocol):
    """The seam between a front end and the tokenizer process (TokenizerServer): the
    core, whose entry points (`submit`, `abort`, `query_stats`, `forget`; `limits`,
    `codec`) every front end calls, the ZeroMQ socket through `core.handle`, and
    `send`, which passes what they return on to the scheduler and delivers the
    replies their sinks queued; `engines_up`, how many engines serve now."""

    core: "TokenizerCore"
    engines_up: int

    async def send(self, to_scheduler: "list[ToScheduler]" = ()) -> None: ...


class Disconnected(Exception):
    """The HTTP client went away; its requests were aborted."""


class Cancelled(Exception):
    """The call was cancelled from outside its request; its requests were aborted."""


_GONE = object()   # put on a call's queue when its client disconnects
_CANCELLED = object()   # put on it by `cancel`
_keys = itertools.count()


class Call:
    def __init__(self, front: Front):
        self.front = front
        self.key = ("http", next(_keys))
        self._replies: deque = deque()
        self._arrived = asyncio.Event()
        self.running = 0          # choices that have not finished
        self.choices = 1          # per request (`n`)
        self._watcher: asyncio.Task | None = None
        self.disconnected = False

    async def start(self, requests: list[GenerateRequest], choices: int = 1) -> None:
        """Submit the requests (rids unique within the call), each generating
        `choices` outputs (its `n`): a finishing chunk ends one, an error all."""
        self.choices = choices
        self.running += len(requests) * choices
        for req in requests:
            await self.front.send(self.front.core.submit(self.key, req, self._put))

    def _put(self, reply) -> None:
        self._replies.append(reply)
        self._arrived.set()

    def queued(self) -> list:
        """The replies that arrived and were not taken yet."""
        return list(self._replies)

    async def next_reply(self) -> StreamChunk | ErrorReply:
        """The next reply; raises Disconnected once the client is gone, Cancelled once
        the call is cancelled."""
        while not self._replies:
            self._arrived.clear()
            await self._arrived.wait()
        reply = self._replies.popleft()
        if reply is _GONE:
            raise Disconnected()
        if reply is _CANCELLED:
            raise Cancelled()
        if isinstance(reply, ErrorReply):
            self.running -= self.choices
        elif isinstance(reply, StreamChunk) and reply.finish_reason:
            self.running -= 1
        return reply

    def usage_so_far(self, rid: str) -> dict | None:
        """The usage of the call's running request `rid` as the scheduler last told it
        (from its first token on)."""
        usage = self.front.core.usage_so_far(self.key, rid)
        return None if usage is None else usage.as_dict()

    async def stats(self) -> dict:
        """The scheduler's counters (StatsReply.stats)."""
        await self.front.send(self.front.core.query_stats(self.key, "stats",
                                                          self._put))
        reply = await asyncio.wait_for(self.next_reply(), STATS_TIMEOUT)
        if not isinstance(reply, StatsReply):
            raise ApiError(500, f"unexpected reply to a stats query: {reply!r}")
        return reply.stats

    def watch(self, receive) -> None:
        """Close the call as soon as the client disconnects (`receive`: the request's
        ASGI receive, its body already read)."""
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        await self.close()
        self._put(_GONE)

    async def cancel(self) -> None:
        """Abort the call from elsewhere (another request): its reader gets Cancelled."""
        await self.close()
        self._put(_CANCELLED)

    async def close(self) -> None:
        """Abort whatever of the call still runs; nothing more reaches its queue."""
        if self._watcher is not None and not self.disconnected:
            self._watcher.cancel()
        await self.front.send(self.front.core.forget(self.key))

