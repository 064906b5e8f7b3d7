"""Recent responses of the Responses API, in memory, by id, per API key.

`store: true` (OpenAI's default) keeps a response here from the moment it starts: while
it runs it can be read (status `in_progress`) and cancelled; once it ends it can be
read, continued (`previous_response_id`) and deleted. The store is bounded by count and
by size (the responses' JSON, roughly), the least recently used going first; it lives
and dies with the process. A response is visible only to the key that made it (a
digest of the credential the request carried; one namespace without one), and an id
that is not there, or not the caller's, is a 404 alike."""

import asyncio
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from fastapi import Request

from .errors import ApiError

MAX_RESPONSES = 1024
MAX_CHARS = 256 << 20


def owner_of(request: Request) -> str:
    """Whose responses a request may see: a digest of its credential (the API key
    checked by app.authorize, or any the client sent when none is set)."""
    given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
    given = given[7:] if given[:7].lower() == "bearer " else given
    return hashlib.sha256(given.encode()).hexdigest()


@dataclass(eq=False)
class Stored:
    owner: str
    response: dict            # the Response object as last rendered
    history: list[dict] = field(default_factory=list)   # chat messages, to continue from
    input_items: list[dict] = field(default_factory=list)
    cancel: Callable[[], Awaitable[None]] | None = None   # while it runs
    done: asyncio.Event = field(default_factory=asyncio.Event)
    chars: int = 0

    @property
    def running(self) -> bool:
        return not self.done.is_set()


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._by_id: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def start(self, owner: str, response: dict, cancel) -> Stored:
        """Keep a response that has begun; `cancel()` aborts it."""
        entry = Stored(owner, response, cancel=cancel)
        self._put(response["id"], entry)
        return entry

    def finish(self, entry: Stored, response: dict, history: list[dict],
               input_items: list[dict]) -> None:
        """The response ended: keep its final form (unless it was deleted meanwhile)."""
        entry.response, entry.history, entry.input_items = response, history, input_items
        entry.cancel = None
        entry.done.set()
        if self._by_id.get(response["id"]) is entry:
            self._put(response["id"], entry)

    def drop(self, entry: Stored) -> None:
        """Forget a response that will not end (its client went away)."""
        entry.done.set()
        if self._by_id.get(entry.response["id"]) is entry:
            self._remove(entry.response["id"])

    def get(self, owner: str, response_id: str, param: str | None = None) -> Stored:
        entry = self._by_id.get(response_id)
        if entry is None or entry.owner != owner:
            raise ApiError(404, f"no response with id {response_id!r} is stored here (it "
                                "may have been deleted, evicted or made with store: false)",
                           param, "not_found")
        self._by_id.move_to_end(response_id)
        return entry

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        self._remove(response_id)

    def _put(self, response_id: str, entry: Stored) -> None:
        if response_id in self._by_id:
            self._remove(response_id)
        entry.chars = len(json.dumps(entry.response)) + len(json.dumps(entry.history)) + \
            len(json.dumps(entry.input_items))
        self._by_id[response_id] = entry
        self._chars += entry.chars
        while len(self._by_id) > self.max_responses or \
                (self._chars > self.max_chars and len(self._by_id) > 1):
            self._remove(next(iter(self._by_id)))

    def _remove(self, response_id: str) -> None:
        self._chars -= self._by_id.pop(response_id).chars
