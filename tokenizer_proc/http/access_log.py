"""The access log: one line per HTTP request, at info level on `mlxd.http.access`
(method, path, status, latency, model, prompt and completion tokens, resumes after a
process death when there were any, and the error
message of a 4xx or 5xx), written when the response has been sent (a stream: when it
ended). `--no-access-log` leaves the middleware out.

A route notes what only it knows on the request's `AccessNote` (`access_note`): the
model its body names (`context.read_body`) and the tokens of its generations
(`generation.Generation`). The error message is read from the error body itself,
which both APIs' shapes carry as `error.message`."""

import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request

from mlxd.protocol import StreamChunk

log = logging.getLogger("mlxd.http.access")
STATE_KEY = "mlxd_access"
MAX_ERROR_BODY = 8192   # bytes of an error body kept to read its message
CLIENT_GONE = 499   # the status of a request whose client went away (nginx's; app.py)


@dataclass
class AccessNote:
    """What a route tells the access log about its request."""

    model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    resumes: int = 0   # process deaths its generations lived through
    _requests: set = field(default_factory=set)   # rids whose prompt was counted

    def count(self, chunk: StreamChunk) -> None:
        """A finished choice's usage: each request's prompt once, every choice's output."""
        if chunk.usage is None:
            return
        if chunk.rid not in self._requests:
            self._requests.add(chunk.rid)
            self.prompt_tokens += chunk.usage["prompt_tokens"]
        self.completion_tokens += chunk.usage["completion_tokens"]
        self.resumes += chunk.usage.get("resumes", 0)


def access_note(request: Request) -> AccessNote | None:
    """The request's note, None when the access log is off."""
    return request.scope.get("state", {}).get(STATE_KEY)


def error_message(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200] or None


class AccessLog:
    """ASGI middleware writing the access log."""

    def __init__(self, app, clock=time.monotonic):
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        note = AccessNote()
        scope.setdefault("state", {})[STATE_KEY] = note
        started, status, error_body = self.clock(), [500], bytearray()

        async def noting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and status[0] >= 400 and \
                    len(error_body) < MAX_ERROR_BODY:
                error_body.extend(message.get("body", b"")[:MAX_ERROR_BODY])
            await send(message)
        try:
            await self.app(scope, receive, noting_send)
        finally:
            self._write(scope, note, status[0], self.clock() - started, bytes(error_body))

    @staticmethod
    def _write(scope, note: AccessNote, status: int, seconds: float, error: bytes) -> None:
        line = f'{scope["method"]} {scope["path"]} {status} {seconds * 1000:.1f}ms'
        if note.model is not None:
            line += f" model={note.model}"
        if note.prompt_tokens or note.completion_tokens:
            line += f" prompt_tokens={note.prompt_tokens} " \
                    f"completion_tokens={note.completion_tokens}"
        if note.resumes:
            line += f" resumes={note.resumes}"
        if status >= 400:
            gone = "the client went away" if status == CLIENT_GONE else None
            line += f" error={error_message(error) or gone!r}"
        log.info(line)
