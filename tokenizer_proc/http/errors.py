"""Errors of the HTTP API, in each API's own shape.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Anthropic:
`{"type": "error", "error": {"type", "message"}}`. Routes raise `ApiError`; the
handlers installed by `install_error_handlers` answer it, FastAPI's validation error
(400, not the framework's 422) and any unexpected exception in the shape of the API
the path belongs to."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("mlxd.http")

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# OpenAI's error type for each status; Anthropic's differ (below).
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 405: "invalid_request_error",
                   413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


class ApiError(Exception):
    """An answer other than 200: `param` names the offending parameter, if one did."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers   # e.g. Retry-After on a 503


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)


def openai_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": OPENAI_TYPES.get(err.status, "error"),
                      "param": err.param, "code": err.code}}


def anthropic_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def error_body(path: str, err: ApiError) -> dict:
    """The error in the shape of the API that `path` belongs to."""
    return anthropic_body(err) if path in ANTHROPIC_PATHS else openai_body(err)


def error_response(path: str, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(path, err), status_code=err.status, headers=err.headers)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """A body that does not fit its model: 400 naming the first offending field."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if _names_field(p)) or None
    if first.get("type") == "extra_forbidden":
        message = f"{param}: this server does not support the parameter"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else \
            first.get("msg", "invalid request body")
    return ApiError(400, message, param, first.get("type"))


def _names_field(part) -> bool:
    """A part of pydantic's error location that names a field or an index (not the
    body, nor a member of a union: `str`, `list[int]`, `literal['text']`)."""
    if isinstance(part, int):
        return True
    return part != "body" and part.isidentifier() and part not in _TYPE_NAMES


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(request.url.path, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("HTTP request %s failed", request.url.path)
        return error_response(request.url.path,
                              ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))
