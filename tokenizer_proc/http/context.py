"""What every route needs: the tokenizer process it submits to, the served model's
name, the API key, the metrics; and reading a JSON body into its model."""

import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ..text import TextCodec
from ..validation import ModelLimits
from .access_log import access_note
from .calls import Front
from .compat import Compat, without_nulls
from .errors import ApiError, bad_request, validation_error
from .metrics import Metrics

MAX_BODY_BYTES = 64 << 20


@dataclass
class Api:
    front: Front
    model_name: str
    api_key: str = ""
    metrics: Metrics = field(default_factory=Metrics)
    compat: Compat = field(default_factory=Compat)   # the compatibility policy (compat.py)
    started: float = field(default_factory=time.time)   # when the server started

    def __post_init__(self):
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

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
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")

    def check_ready(self) -> None:
        if self.limits is None:
            raise ApiError(503, "the server is starting: the model is not ready yet")


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
