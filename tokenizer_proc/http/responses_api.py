"""OpenAI's Responses API: `POST /v1/responses` (streamed or not), and, for responses
kept with `store`, `GET` / `DELETE /v1/responses/{id}`, `POST .../{id}/cancel` and
`GET .../{id}/input_items`. Requests go through the same core as chat completions
(one chat request: `instructions` as the system message, the stored conversation of
`previous_response_id`, then the input items; responses_items.py); the chunks become
output items (reasoning, message, function_call) and the Responses stream events
(response_render.py)."""

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxd.protocol import PARAMS

from .access_log import access_note
from .context import Api, read_body
from .errors import ApiError, bad_request
from .generation import Generation
from .openai_api import respond
from .requests import core_error, core_params, generate_requests
from .response_render import ResponseRender
from .responses_items import (
    chat_messages, input_items, logprobs_asked, response_format, tool_params,
)
from .responses_schema import IGNORED, LOGPROBS, ResponsesRequest
from .responses_store import ResponseStore, Stored, owner_of

API = "responses"   # this API's name in the log (compat.Compat.note)
# The core's names the errors name -> this API's
RENAMED = {"max_tokens": "max_output_tokens", "prompt": "input", "input_ids": "input",
           "messages": "input", "response_format": "text.format",
           "enable_thinking": "reasoning"}
CANCEL_WAIT = 5.0   # seconds a cancel waits for the response to settle


class Responses:
    """The routes, over one store of responses (one per app)."""

    def __init__(self, store: ResponseStore | None = None):
        self.store = store or ResponseStore()

    def routes(self) -> dict:
        return {("POST", "/v1/responses"): self.create,
                ("GET", "/v1/responses/{response_id}"): self.retrieve,
                ("DELETE", "/v1/responses/{response_id}"): self.delete,
                ("POST", "/v1/responses/{response_id}/cancel"): self.cancel,
                ("GET", "/v1/responses/{response_id}/input_items"): self.input_items}

    async def create(self, api: Api, request: Request):
        body = await read_body(request, ResponsesRequest)
        note_ignored(api, body)
        api = await api.for_model(body.model)
        api.check_ready()
        owner = owner_of(request)
        history = self._history(owner, body.previous_response_id)
        items = input_items(body)
        new = chat_messages(items, history)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        if not history + new:
            raise bad_request("input is empty: send a text or at least one item", "input")
        logprobs = logprobs_asked(body)
        params = core_params(body, body.max_output_tokens, logprobs=logprobs or None,
                             top_logprobs=body.top_logprobs,
                             response_format=response_format(body), **tool_params(body))
        gen = Generation(api.front, api.metrics, lambda e: core_error(e, RENAMED),
                         access_note(request))
        requests = generate_requests([{"messages": system + history + new}], params,
                                     body.stream)
        await gen.begin(requests, request.receive)
        render = ResponseRender(api.token_text, head(api, body), [r.rid for r in requests],
                                logprobs)
        if body.store:
            entry = self.store.start(owner, render.snapshot("in_progress"), gen.call.cancel)
            kept = [with_id(item.model_dump(by_alias=True)) for item in items]
            render.on_end = lambda response: self._end(entry, response, history + new, kept)
        return await respond(gen, body.stream, render.response, render.events)

    def _history(self, owner: str, previous: str | None) -> list[dict]:
        """The conversation a response continues: its input and output, as messages."""
        if previous is None:
            return []
        entry = self.store.get(owner, previous, "previous_response_id")
        if entry.running:
            raise bad_request(f"the response {previous!r} is still in progress",
                              "previous_response_id")
        return entry.history

    def _end(self, entry: Stored, response: dict | None, conversation: list[dict],
             items: list[dict]) -> None:
        if response is None:   # the client went away
            self.store.drop(entry)
        else:
            self.store.finish(entry, response, conversation + chat_messages(
                response["output"]), items)

    async def retrieve(self, api: Api, request: Request):
        """The response as it is now (a running one: so far, status in_progress)."""
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("a stored response is not streamed again here: read it "
                              "whole (stream=false)", "stream")
        return JSONResponse(self._entry(request).response)

    async def delete(self, api: Api, request: Request):
        response_id = request.path_params["response_id"]
        self.store.delete(owner_of(request), response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, api: Api, request: Request):
        """Abort a response in progress; answers it as it ended (status `cancelled`)."""
        entry = self._entry(request)
        if not entry.running or entry.cancel is None:
            raise bad_request(f"the response is {entry.response['status']}: only a response "
                              "in progress can be cancelled", "response_id")
        await entry.cancel()
        try:
            await asyncio.wait_for(entry.done.wait(), CANCEL_WAIT)
        except TimeoutError:
            pass
        return JSONResponse(entry.response)

    async def input_items(self, api: Api, request: Request):
        """The items a stored response was given (its own input, not its predecessors'),
        newest first unless `order=asc`, as OpenAI lists them."""
        items = list(self._entry(request).input_items)
        if request.query_params.get("order", "desc") != "asc":
            items.reverse()
        return JSONResponse({"object": "list", "data": items, "has_more": False,
                             "first_id": items[0]["id"] if items else None,
                             "last_id": items[-1]["id"] if items else None})

    def _entry(self, request: Request) -> Stored:
        return self.store.get(owner_of(request), request.path_params["response_id"])


def note_ignored(api: Api, body: ResponsesRequest) -> None:
    """Say once in the log which fields sent have no effect here, as the compatibility
    policy does for the other APIs."""
    for path, why in IGNORED.items():
        value = body
        for name in path:
            value = getattr(value, name, None)
        if value is not None:
            api.compat.note(API, ".".join(path), why)
    for kind in body.include or ():
        if kind != LOGPROBS:
            api.compat.note(API, f"include {kind}", "no hosted tool's data here")
    for kind in body.hosted_tools:
        api.compat.note(API, f"tools of type {kind}",
                        "a hosted tool: this server runs none, so the model is not offered it")


def head(api: Api, body: ResponsesRequest) -> dict:
    """The Response object's fields that echo the request."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response",
        "created_at": int(time.time()), "model": api.model_name,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": _sent_or_default(body, "temperature"),
        "top_p": _sent_or_default(body, "top_p"), "top_logprobs": body.top_logprobs,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": _dumped(body.tool_choice) or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": {"type": "text"}, **text},
        "reasoning": _dumped(body.reasoning), "store": body.store,
        "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
        "background": False, "error": None, "incomplete_details": None, "usage": None,
    }


def _sent_or_default(body, name: str):
    value = getattr(body, name)
    return PARAMS[name].default if value is None else value


def _dumped(value):
    if value is None or isinstance(value, str):
        return value
    return value.model_dump(exclude_none=True)


def with_id(item: dict) -> dict:
    """An input item as listed back: with an id (the client's, or one made here)."""
    if not item.get("id"):
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}[item["type"]]
        item = {**item, "id": f"{prefix}_{uuid.uuid4().hex}"}
    return item

