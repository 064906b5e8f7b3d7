"""The FastAPI application: routes, API key, request counting.

Every generation goes through the tokenizer's core like a ZeroMQ client's
(generation.py); /tokenize and /detokenize use its codec directly."""

import time
from typing import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.routing import compile_path

from mlxd.tokenizer_proc.auth import key_matches
from mlxd.tokenizer_proc.params import InvalidRequest
from mlxd.tokenizer_proc.validation import checked_messages, max_prompt_chars, model_vocab_size

from . import anthropic_api, openai_api
from .access_log import CLIENT_GONE, AccessLog
from .calls import Call, Disconnected
from .context import Api, read_body
from .errors import ApiError, bad_request, install_error_handlers
from .openai_api import chat_messages
from .openai_schema import DetokenizeRequest, TokenizeRequest
from .responses_api import Responses

OPEN_PATHS = ("/health", "/metrics")   # no API key asked


def authorize(api: Api, request: Request) -> None:
    """401 unless the request carries the key: `Authorization: Bearer KEY` or
    Anthropic's `x-api-key: KEY`."""
    if not api.api_key:
        return
    bearer = request.headers.get("authorization", "")
    given = bearer[7:] if bearer[:7].lower() == "bearer " else request.headers.get("x-api-key")
    if given is None or not key_matches(api.api_key, given):
        raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY "
                            "(or x-api-key: KEY)", code="invalid_api_key")


Route = Callable[[Api, Request], Awaitable[Response]]


def _guarded(api: Api, route: Route):
    """The route behind the API key; a client gone meanwhile gets nothing."""
    async def handle(request: Request):
        authorize(api, request)
        try:
            return await route(api, request)
        except Disconnected:
            return Response(status_code=CLIENT_GONE)
    return handle


def _open(api: Api, route: Route):
    async def handle(request: Request):
        return await route(api, request)
    return handle


def build_app(api: Api, access_log: bool = False) -> FastAPI:
    """The app; with `access_log`, a line per request (access_log.py)."""
    app = FastAPI(title="mlxd", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    routes = {("POST", "/v1/chat/completions"): openai_api.chat_completions,
              ("POST", "/v1/completions"): openai_api.completions,
              ("POST", "/v1/messages"): anthropic_api.messages,
              ("POST", "/v1/messages/count_tokens"): anthropic_api.count_tokens,
              ("GET", "/v1/models"): models,
              ("GET", "/v1/models/{model:path}"): model,
              ("POST", "/admin/models/load"): load_model,
              ("POST", "/admin/models/unload"): unload_model,
              ("POST", "/tokenize"): tokenize,
              ("POST", "/detokenize"): detokenize,
              **Responses().routes()}
    for (method, path), route in routes.items():
        app.add_api_route(path, _guarded(api, route), methods=[method])
    for path, route in (("/health", health), ("/metrics", metrics)):
        app.add_api_route(path, _open(api, route), methods=["GET"])
    known = {path for _, path in routes} | set(OPEN_PATHS)
    app.add_middleware(CountRequests, api=api, known=known)
    if access_log:
        app.add_middleware(AccessLog)
    return app


class CountRequests:
    """ASGI middleware: each response's status, by endpoint: the route's path, its
    parameters as declared (`/v1/responses/{response_id}`); paths not served count
    as `other`, so that their number stays bounded."""

    def __init__(self, app, api: Api, known: set[str]):
        self.app, self.api, self.known = app, api, known
        self.templates = [(compile_path(path)[0], path.replace(":path}", "}"))
                          for path in sorted(known) if "{" in path]

    def endpoint(self, path: str) -> str:
        if path in self.known:
            return path
        return next((name for pattern, name in self.templates if pattern.match(path)),
                    "other")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = self.endpoint(scope["path"])

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.api.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counting_send)


def _model_card(api: Api, request: Request, served=None) -> dict:
    """OpenAI's model object, or Anthropic's to a client that sends the
    `anthropic-version` header (as Anthropic's SDK does); with several models, each
    with its state (loaded, loading, unloading, unloaded, or failed with its `failure`)
    and aliases."""
    name = served.name if served is not None else api.model_name
    limits = served.core.limits if served is not None else api.limits
    context = limits.max_context if limits is not None and limits.max_context else None
    extra = served.card() if served is not None else {}
    if "anthropic-version" in request.headers:
        card = {"type": "model", "id": name, "display_name": name,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(api.started))}
        return {**card, "max_input_tokens": context, **extra} if context else {**card, **extra}
    card = {"id": name, "object": "model", "created": int(api.started), "owned_by": "mlxd",
            **extra}
    return {**card, "max_model_len": context} if context else card


def _cards(api: Api, request: Request) -> list[dict]:
    if api.directory is None:
        return [_model_card(api, request)]
    return [_model_card(api, request, served) for served in api.directory.listing()]


async def models(api: Api, request: Request):
    cards = _cards(api, request)
    if "anthropic-version" in request.headers:
        return JSONResponse({"data": cards, "has_more": False, "first_id": cards[0]["id"],
                             "last_id": cards[-1]["id"]})
    return JSONResponse({"object": "list", "data": cards})


async def model(api: Api, request: Request):
    name = request.path_params["model"]
    if api.directory is None:
        api.check_model(name)
        return JSONResponse(_model_card(api, request))
    return JSONResponse(_model_card(api, request, api.served(name)))


async def health(api: Api, request: Request):
    status = api.status()
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


async def metrics(api: Api, request: Request):
    stats: dict[str, dict] = {}
    served_models = api.directory.listing() if api.directory is not None else [None]
    for served in served_models:
        view = api if served is None else api.view(served)
        if view.limits is None or (served is not None and served.state != "loaded"):
            continue
        call = Call(view.front)
        try:
            stats[view.model_name] = await call.stats()
        except TimeoutError:   # the scheduler is busy: the front end's own figures
            pass
        finally:
            await call.close()
    return Response(api.metrics.render(stats, _model_states(api)),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


async def _admin_target(api: Api, request: Request):
    body = await read_body(request, ModelAction)
    if api.directory is None:
        raise bad_request("this server serves one model, loaded while it runs", "model")
    return api.served(body.model)


async def load_model(api: Api, request: Request):
    """Load a model now (unloading the least recently used to make room, as a
    request for it would); answers its card once loaded, 503 past the load timeout."""
    served = await _admin_target(api, request)
    await api.for_model(served.name)
    return JSONResponse(_model_card(api, request, served))


async def unload_model(api: Api, request: Request):
    """Unload a model (pinned ones too): its running requests finish first, within
    --unload-grace-seconds; answers its card once unloaded."""
    served = await _admin_target(api, request)
    assert api.directory is not None
    await api.directory.unload(served)
    return JSONResponse(_model_card(api, request, served))


def _model_states(api: Api) -> list[dict]:
    if api.directory is None:
        return []
    return [{"model": s.name, "state": s.state, "loads": s.loads, "unloads": s.unloads,
             "failures": s.failures} for s in api.directory.listing()]


async def tokenize(api: Api, request: Request):
    """vLLM's /tokenize: a prompt (as /v1/completions encodes it) or chat messages
    (as /v1/chat/completions renders them)."""
    body = await read_body(request, TokenizeRequest)
    api = await api.for_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt or messages")
    limits = api.limits
    max_chars = max_prompt_chars(limits, api.codec.max_chars_per_token)
    if body.prompt is not None and max_chars is not None and len(body.prompt) > max_chars:
        raise bad_request(f"the prompt has {len(body.prompt)} characters; at most "
                          f"{max_chars} can fit the model's context", "prompt")
    try:
        if body.messages is not None:
            tokens = api.codec.encode_chat(checked_messages(chat_messages(body.messages)))
        elif body.add_special_tokens:
            tokens = api.codec.encode_prompt(body.prompt)
        else:
            tokens = api.codec.encode_text(body.prompt)
    except InvalidRequest as exc:
        raise bad_request(str(exc), "messages") from None
    return JSONResponse({"tokens": tokens, "count": len(tokens),
                         "max_model_len": limits.max_context if limits else None})


async def detokenize(api: Api, request: Request):
    body = await read_body(request, DetokenizeRequest)
    api = await api.for_model(body.model)
    vocab = model_vocab_size(api.limits, api.codec)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"tokens must be token ids in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": api.codec.decode(body.tokens)})
