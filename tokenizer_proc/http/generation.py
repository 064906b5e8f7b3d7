"""Running one HTTP request's generations: a `Call` whose errors before any output
become an ApiError (so a bad request is a 400, also when streaming), then its replies
as they come. The client's disconnect aborts it at once, through the call's watch."""

import time
from typing import AsyncIterator, Callable

from mlxd.protocol import ErrorReply, GenerateRequest, StreamChunk

from .access_log import AccessNote
from .calls import Call, Front
from .errors import ApiError
from .metrics import Metrics

ToError = Callable[[ErrorReply], ApiError]


class Generation:
    def __init__(self, front: Front, metrics: Metrics, to_error: ToError,
                 note: AccessNote | None = None):
        """`note`: the request's in the access log, which gets its token counts."""
        self.call = Call(front)
        self.metrics = metrics
        self.note = note
        self.to_error = to_error
        self._first: StreamChunk | None = None
        self._started = time.monotonic()
        self._last = None   # when the previous token came

    async def begin(self, requests: list[GenerateRequest], receive, n: int = 1) -> None:
        """Submit and wait for the first reply: an error is raised (the call is closed)."""
        try:
            await self.call.start(requests, n)
            self.call.watch(receive)
            first = await self.call.next_reply()
            refused = [r for r in [first, *self.call.queued()]
                       if isinstance(r, ErrorReply)]
            if refused:
                raise self.to_error(refused[0])
        except BaseException:
            await self.call.close()
            raise
        self._first = first
        self._observe(first)

    async def replies(self) -> AsyncIterator[StreamChunk]:
        """Every chunk (the first included) until all choices finished; an error
        reply raises ApiError; the call is closed at the end, however it ends."""
        try:
            yield self._first
            while self.call.running > 0:
                reply = await self.call.next_reply()
                if isinstance(reply, ErrorReply):
                    raise self.to_error(reply)
                self._observe(reply)
                yield reply
        finally:
            await self.call.close()

    def _observe(self, chunk: StreamChunk) -> None:
        now = time.monotonic()
        if chunk.token_ids:
            if self._last is None:
                self.metrics.ttft.observe(now - self._started)
            else:
                self.metrics.inter_token.observe((now - self._last) / len(chunk.token_ids))
            self._last = now
        if chunk.finish_reason:
            self.metrics.finished(chunk, now - self._started)
            if self.note is not None:
                self.note.count(chunk)


def failed(chunk: StreamChunk) -> ApiError | None:
    """A choice that ended in an error (a timeout, a worker failure)."""
    if chunk.finish_reason == "error":
        return ApiError(500, chunk.error or "the request failed")
    return None
