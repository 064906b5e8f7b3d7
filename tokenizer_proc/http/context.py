"""What every route needs: the tokenizer process it submits to, the served model's
name, the API key, the metrics; and reading a JSON body into its model.

With several models (`directory` set), a route first resolves the request's `model`
(`Api.for_model`): it gets the view of the API for that model (its core, codec,
limits and name), once the model is loaded."""

import json
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Protocol

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ..model_loader import LoadFailed, ModelUnavailable
from ..models import not_served
from ..text import TextCodec
from ..validation import ModelLimits
from .access_log import access_note
from .calls import Front
from .compat import Compat, without_nulls
from .errors import ApiError, bad_request, validation_error
from .metrics import Metrics

if TYPE_CHECKING:
    from ..models import Served

MAX_BODY_BYTES = 64 << 20


class Directory(Protocol):
    """The served models (the tokenizer process, TokenizerServer)."""

    def find(self, name: str | None) -> "Served | None":
        """The model `name` (or an alias) names; None: the first."""
        ...

    def names(self) -> list[str]: ...

    def listing(self) -> "list[Served]": ...

    async def ready(self, served: "Served") -> None:
        """Once `served` is loaded; raises model_loader.ModelUnavailable or
        LoadFailed."""
        ...

    def front(self, served: "Served") -> Front: ...

    async def unload(self, served: "Served") -> None:
        """Once `served` is unloaded (by an administrator)."""
        ...

    def status(self) -> str:
        """`ok`, `starting`, or `no engine` (a loaded model lost every engine)."""
        ...


@dataclass
class Api:
    front: Front
    model_name: str
    api_key: str = ""
    metrics: Metrics = field(default_factory=Metrics)
    compat: Compat = field(default_factory=Compat)   # the compatibility policy (compat.py)
    started: float = field(default_factory=time.time)   # when the server started
    directory: Directory | None = None   # several models: where `for_model` looks
    _views: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    async def for_model(self, name: str | None) -> "Api":
        """The API as it serves the model `name` (None: the first), waiting for it
        to load: 404 naming the served models for an unknown name, 503 with
        Retry-After if it does not load in time, 503 naming the cause if its load
        failed (the next request tries again)."""
        if self.directory is None:
            self.check_model(name)
            return self
        served = self.served(name)
        try:
            await self.directory.ready(served)
        except ModelUnavailable as exc:
            raise ApiError(503, str(exc), "model", "model_not_loaded",
                           {"Retry-After": str(exc.retry_after)}) from None
        except LoadFailed as exc:
            raise ApiError(503, str(exc), "model", exc.code) from None
        return self.view(served)

    def served(self, name: str | None) -> "Served":
        """The served model `name` names (with a `directory`), loaded or not; 404
        naming the served models for an unknown name."""
        assert self.directory is not None
        served = self.directory.find(name)
        if served is None:
            raise ApiError(404, not_served(name, self.directory.names()), "model",
                           "model_not_found")
        return served

    def view(self, served: "Served") -> "Api":
        """The API for one served model (made once per model)."""
        view = self._views.get(served.name)
        if view is None:
            assert self.directory is not None
            view = self._views[served.name] = replace(
                self, front=self.directory.front(served), model_name=served.name,
                directory=None)
        return view

    @property
    def codec(self) -> TextCodec:
        return self.front.core.codec

    @property
    def limits(self) -> ModelLimits | None:
        """The model's limits; None until the scheduler's READY."""
        return self.front.core.limits

    def _token_text(self, token: int) -> str:
        """One token as text (special tokens spelled out), for logprobs."""
        return self.codec.token_text(token)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, not_served(name, [self.model_name]), "model",
                           "model_not_found")

    def check_ready(self) -> None:
        if self.limits is None:
            raise ApiError(503, "the server is starting: the model is not ready yet")

    def status(self) -> str:
        """`ok`, `starting` (no limits yet) or `no engine` (every engine was lost)."""
        if self.directory is not None:
            return self.directory.status()
        if self.limits is None:
            return "starting"
        return "ok" if self.front.engines_up else "no engine"


async def read_body(request: Request, model: type[BaseModel],
                    policy: Callable[[dict], dict] | None = None):
    """The request's JSON body as `model`, its nulls dropped at every depth and
    `policy` applied first (e.g. `lambda b: api.compat.apply(CHAT, b)`): 400 for bad
    JSON or a body that does not fit, 413 past MAX_BODY_BYTES."""
    raw = await _body(request)
    try:
        body = json.loads(raw)
    except ValueError as exc:   # UnicodeDecodeError included
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    body = without_nulls(body)
    if policy is not None:
        body = policy(body)
    note = access_note(request)
    if note is not None and isinstance(body.get("model"), str):
        note.model = body["model"]
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _body(request: Request) -> bytes:
    """The body, refused (413) as soon as it passes MAX_BODY_BYTES, whether or not
    it declared its length."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        parts.append(part)
    return b"".join(parts)
