"""`POST /v1/chat/completions` and `POST /v1/completions`: bodies to core requests,
chunks to OpenAI's responses and stream events."""

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .access_log import access_note
from .calls import Disconnected
from .compat import CHAT, COMPLETIONS
from .choices import Outputs, chat_logprobs, completion_logprobs
from .context import Api, read_body
from .errors import ApiError, bad_request, openai_body
from .generation import Generation, failed
from .openai_schema import ChatMessage, ChatRequest, CompletionRequest
from .requests import choices_per_request, core_error, core_params, generate_requests
from .sse import DONE, data
from .tool_calls import openai_call, openai_tool_params


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The chat template's messages: text parts joined, `developer` as `system`, tool
    calls and tool results kept (the core checks them)."""
    return [chat_message(m) for m in messages]


def chat_message(m: ChatMessage) -> dict:
    content = m.content if m.content is None or isinstance(m.content, str) else \
        "".join(p.text for p in m.content)
    message = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.tool_calls is not None:
        message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.role == "tool" and m.name is not None:
        message["name"] = m.name
    return message


def prompt_inputs(prompt) -> list[dict]:
    """A completions prompt (text, texts, token ids, lists of token ids) as core inputs."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return [{"prompt": p} for p in prompt]
    if isinstance(prompt[0], int):
        return [{"input_ids": prompt}]
    return [{"input_ids": ids} for ids in prompt]


def continues_final(body: ChatRequest) -> bool | None:
    """Whether the reply continues the final message (an assistant's prefill, as
    Anthropic's API and llama.cpp's server take it): by default when that message is
    the assistant's text, unless the body says otherwise (vLLM's fields)."""
    if body.continue_final_message is not None:
        return body.continue_final_message or None
    last = body.messages[-1]
    prefill = last.role == "assistant" and bool(last.content) and not last.tool_calls
    return (prefill and not body.add_generation_prompt) or None


async def chat_completions(api: Api, request: Request):
    body = await read_body(request, ChatRequest, lambda b: api.compat.apply(CHAT, b))
    api = await api.for_model(body.model)
    api.check_ready()
    n = choices_per_request(body)
    include_usage = usage_in_stream(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = core_params(body, max_tokens, logprobs=body.logprobs or None,
                         top_logprobs=body.top_logprobs, response_format=body.response_format,
                         continue_final_message=continues_final(body),
                         **openai_tool_params(body))
    renamed = {"prompt": "messages", "input_ids": "messages"}
    if body.max_completion_tokens is not None:
        renamed["max_tokens"] = "max_completion_tokens"
    gen = Generation(api.front, api.metrics, lambda e: core_error(e, renamed),
                     access_note(request))
    requests = generate_requests([{"messages": chat_messages(body.messages)}], params,
                                 body.stream)
    await gen.begin(requests, request.receive, n)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": api.model_name}
    render = ChatRender(api, head, Outputs([r.rid for r in requests], n), body.logprobs)
    return await respond(gen, body.stream, render.response,
                         lambda chunks: render.events(chunks, include_usage))


async def completions(api: Api, request: Request):
    body = await read_body(request, CompletionRequest,
                           lambda b: api.compat.apply(COMPLETIONS, b))
    api = await api.for_model(body.model)
    api.check_ready()
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported: prompt tokens' logprobs "
                          "are not computed", "echo")
    n = choices_per_request(body)
    include_usage = usage_in_stream(body)
    inputs = prompt_inputs(body.prompt)
    params = core_params(body, body.max_tokens, logprobs=body.logprobs is not None or None,
                         top_logprobs=body.logprobs or None,
                         response_format=body.response_format)
    renamed = {"top_logprobs": "logprobs", "input_ids": "prompt", "prompt": "prompt"}
    gen = Generation(api.front, api.metrics, lambda e: core_error(e, renamed),
                     access_note(request))
    requests = generate_requests(inputs, params, body.stream)
    await gen.begin(requests, request.receive, n)
    echo = [echoed_prompt(api, given) for given in inputs] if body.echo else None   # valid ids
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": api.model_name}
    render = CompletionRender(api, head, Outputs([r.rid for r in requests], n, echo),
                              body.logprobs is not None)
    return await respond(gen, body.stream, render.response,
                         lambda chunks: render.events(chunks, include_usage))


def usage_in_stream(body) -> bool:
    """`stream_options.include_usage`; stream options without a stream are refused."""
    if body.stream_options is None:
        return False
    if not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return body.stream_options.include_usage


def echoed_prompt(api: Api, given: dict) -> str:
    if "prompt" in given:
        return given["prompt"]
    return api.codec.decode(given["input_ids"])


async def respond(gen: Generation, stream: bool, whole, events):
    """The generation's answer: `whole(chunks)` as JSON, or `events(chunks)` as
    server-sent events; the call is closed however it ends."""
    if stream:
        return StreamingResponse(_closing(gen, events(gen.replies())),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(await whole(gen.replies()))
    finally:
        await gen.call.close()


async def _closing(gen: Generation, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The events until the stream ends or its client goes; then the call is closed."""
    try:
        async for piece in events:
            yield piece
    except Disconnected:
        pass
    finally:
        await gen.call.close()


class _Render:
    """Chunks to one API's JSON: `response` collects them all, `events` streams."""

    OBJECT = CHUNK_OBJECT = ""

    def __init__(self, api: Api, head: dict, outputs: Outputs, logprobs: bool):
        self.api, self.head, self.outputs, self.logprobs = api, head, outputs, logprobs

    async def response(self, chunks) -> dict:
        async for chunk in chunks:
            self.outputs.add(chunk)
            error = failed(chunk)
            if error:
                raise error
        return {**self.head, "object": self.OBJECT,
                "choices": [self.final_choice(c) for c in self.outputs.in_order()],
                "usage": self.outputs.usage()}

    async def events(self, chunks, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                choice, text = self.outputs.add(chunk)
                error = failed(chunk)
                if error:
                    yield data(openai_body(error))
                    return
                if not (text or chunk.finish_reason or not choice.seen or chunk.reasoning
                        or chunk.tool_calls or (self.logprobs and chunk.token_ids)):
                    continue   # tokens whose text is held back (a partial character)
                event = {**self.head, "object": self.CHUNK_OBJECT,
                         "choices": [self.chunk_choice(choice, chunk, text)]}
                yield data({**event, "usage": None} if include_usage else event)
                choice.seen = True
            if include_usage:
                yield data({**self.head, "object": self.CHUNK_OBJECT, "choices": [],
                            "usage": self.outputs.usage()})
            yield DONE
        except ApiError as exc:   # a request refused after the stream began
            yield data(openai_body(exc))


class ChatRender(_Render):
    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def final_choice(self, c) -> dict:
        message = {"role": "assistant",
                   "content": None if c.tool_calls and not c.text else c.text}
        if c.reasoning:
            message["reasoning_content"] = message["reasoning"] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = [openai_call(call) for call in c.tool_calls]
        return {"index": c.index, "message": message,
                "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                "finish_reason": c.finish_reason}

    def chunk_choice(self, choice, chunk, text: str) -> dict:
        delta = {} if choice.seen else {"role": "assistant"}
        if text or not choice.seen:
            delta["content"] = text
        if chunk.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = chunk.reasoning
        if chunk.tool_calls:
            delta["tool_calls"] = [openai_call(call, True) for call in chunk.tool_calls]
        return {"index": choice.index, "delta": delta,
                "logprobs": self._logprobs(chunk.token_ids, chunk.logprobs or [],
                                           chunk.top_logprobs or []),
                "finish_reason": chunk.finish_reason}

    def _logprobs(self, ids, logprobs, tops) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(self.api.token_text, ids, logprobs, tops)


class CompletionRender(_Render):
    OBJECT = CHUNK_OBJECT = "text_completion"

    def final_choice(self, c) -> dict:
        echo = self.outputs.echo
        start = len(echo[c.index // self.outputs.n]) if echo else 0
        return {"index": c.index, "text": c.text,
                "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, start),
                "finish_reason": c.finish_reason}

    def chunk_choice(self, choice, chunk, text: str) -> dict:
        offset = len(choice.text) - len(text)
        return {"index": choice.index, "text": text,
                "logprobs": self._logprobs(chunk.token_ids, chunk.logprobs or [],
                                           chunk.top_logprobs or [], offset),
                "finish_reason": chunk.finish_reason}

    def _logprobs(self, ids, logprobs, tops, offset: int) -> dict | None:
        if not self.logprobs:
            return None
        return completion_logprobs(self.api.token_text, ids, logprobs, tops, offset)
