"""`POST /v1/messages`, Anthropic's Messages API: text and tool calls in and out,
streamed as its named events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop); a tool call is a `tool_use` block whose input comes
as one `input_json_delta`. `POST /v1/messages/count_tokens` counts a request's
prompt as it would be rendered. A final assistant message is a prefill: the reply
continues it."""

import asyncio
import re
import uuid
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxd.protocol import ErrorReply, GenerateRequest

from ..params import InvalidRequest
from .access_log import access_note
from .anthropic_schema import (
    PASSED, CountTokensRequest, Message, MessagesRequest, TextBlock, ToolResultBlock,
    ToolUseBlock,
)
from .choices import Choice, Outputs
from .compat import MESSAGES
from .context import Api, read_body
from .errors import ApiError, anthropic_body
from .generation import Generation, failed
from .openai_api import respond
from .requests import core_error, generate_requests
from .sse import event
from .tool_calls import anthropic_tool_params, anthropic_tool_use

# The core's names the errors name -> this API's
RENAMED = {**{name: field for field, name in PASSED.items() if field != name},
           "prompt": "messages", "input_ids": "messages"}
# The core's length errors (runtime/request_limits.py), in Anthropic's words, which
# clients (Claude Code) read to know that the history must be compacted.
TOO_LONG = re.compile(r"the prompt has (\d+) tokens; the (?:model's context is|KV cache "
                      r"holds) (\d+) tokens")
TOO_LONG_WITH_OUTPUT = re.compile(r"the prompt has (\d+) tokens and max_tokens allows "
                                  r"(\d+) more; the KV cache holds (\d+) tokens")


def _text(content) -> str:
    """The text of a content: a string, or its text blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def _turn(m: Message) -> list[dict]:
    """One Anthropic message as chat-template messages: tool results become `tool`
    messages (before the user's text), tool_use blocks an assistant's tool_calls."""
    blocks = [] if isinstance(m.content, str) else m.content
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in blocks if isinstance(b, ToolResultBlock)]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    text = _text(m.content)
    own = {"role": m.role, "content": text, **({"tool_calls": calls} if calls else {})}
    return results + ([own] if text or calls or not results else [])


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The chat: one system message first (the body's `system`, then the text of any
    system message among the messages: templates take a system prompt first only),
    then the turns."""
    system = [_text(body.system)] if body.system else []
    system += [_text(m.content) for m in body.messages if m.role == "system"]
    first = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return first + [message for m in body.messages if m.role != "system"
                    for message in _turn(m)]


def prefilled(body: MessagesRequest) -> bool:
    """A final assistant message of text is the start of the reply, to continue."""
    last = body.messages[-1]
    blocks = [] if isinstance(last.content, str) else last.content
    return last.role == "assistant" and bool(_text(last.content)) and \
        not any(isinstance(b, ToolUseBlock) for b in blocks)


def core_params(body: MessagesRequest) -> dict:
    params = {name: getattr(body, field) for field, name in PASSED.items()
              if getattr(body, field) is not None}
    for name in ("enable_thinking", "response_format"):
        if getattr(body, name) is not None:
            params[name] = getattr(body, name)
    if prefilled(body):
        params["continue_final_message"] = True
    return {**params, **anthropic_tool_params(body.tools, body.tool_choice)}


def anthropic_error(reply: ErrorReply) -> ApiError:
    """The core's refusal; a prompt too long in the words Anthropic's API uses."""
    err = core_error(reply, RENAMED)
    if match := TOO_LONG.search(reply.message):
        n, limit = match.groups()
        err.message = f"prompt is too long: {n} tokens > {limit} maximum"
    elif match := TOO_LONG_WITH_OUTPUT.search(reply.message):
        n, new, limit = map(int, match.groups())
        err.message = (f"input length and `max_tokens` exceed context limit: {n} + {new} "
                       f"> {limit + 1}, decrease input length or `max_tokens` and try again")
    return err


def _policy(api: Api) -> Callable[[dict], dict]:
    return lambda body: api.compat.apply(MESSAGES, body)


async def messages(api: Api, request: Request):
    body = await read_body(request, MessagesRequest, _policy(api))
    api.check_model(body.model)
    api.check_ready()
    params = core_params(body)
    gen = Generation(api.front, api.metrics, anthropic_error, access_note(request))
    requests = generate_requests([{"messages": chat_messages(body)}], params, body.stream)
    await gen.begin(requests, request.receive)
    render = MessageRender(api, [r.rid for r in requests], body.stop_sequences or [],
                           gen.call.usage_so_far)
    return await respond(gen, body.stream, render.response, render.events)


async def count_tokens(api: Api, request: Request):
    """`{"input_tokens": N}`: the prompt a request of this body would have (its
    template, tools and system prompt), counted without running it."""
    body = await read_body(request, CountTokensRequest, _policy(api))
    api.check_model(body.model)
    params = {k: v for k, v in core_params(body).items() if k != "max_tokens"}
    req = GenerateRequest("count", params=params, messages=chat_messages(body))
    try:   # off the event loop: a long prompt holds up no other request
        n = await asyncio.to_thread(api.front.core.prompt_tokens, req)
    except InvalidRequest as exc:
        raise anthropic_error(ErrorReply("count", "invalid_request", str(exc),
                                         exc.param)) from None
    return JSONResponse({"input_tokens": n})


class MessageRender:
    def __init__(self, api: Api, rids: list[str], stop_sequences: list[str],
                 usage_so_far: Callable[[str], dict | None] = lambda rid: None):
        self.api = api
        self.usage_so_far = usage_so_far   # a running request's usage, by rid
        self.stop_sequences = stop_sequences
        self.outputs = Outputs(rids)
        self.id = f"msg_{uuid.uuid4().hex}"
        self._blocks = 0          # content blocks started while streaming
        self._open: str | None = None   # the kind of the block being streamed

    async def response(self, chunks) -> dict:
        async for chunk in chunks:
            choice, _ = self.outputs.add(chunk)
            if failed(chunk):
                raise failed(chunk)
        text = [{"type": "text", "text": choice.text}] \
            if choice.text or not choice.tool_calls else []
        content = text + [anthropic_tool_use(call) for call in choice.tool_calls]
        return {**self._message(content), **self._stop(choice), "usage": self._usage()}

    async def events(self, chunks) -> AsyncIterator[bytes]:
        started = False
        try:
            async for chunk in chunks:
                choice, text = self.outputs.add(chunk)
                if failed(chunk):
                    raise failed(chunk)
                if not started:
                    usage = chunk.usage or self.usage_so_far(chunk.rid)
                    yield event({"type": "message_start", "message": {
                        **self._message([]), "stop_reason": None, "stop_sequence": None,
                        "usage": {**_input_usage(usage), "output_tokens": 0}}})
                    started = True
                for piece in self._content_events(text, chunk.tool_calls or []):
                    yield piece
            if self._blocks == 0:   # nothing at all: one empty text block
                yield self._start({"type": "text", "text": ""})
            yield self._close()   # there is an open block: the last one started
            yield event({"type": "message_delta", "delta": self._stop(choice),
                         "usage": self._usage()})
            yield event({"type": "message_stop"})
        except ApiError as exc:
            yield event(anthropic_body(exc))

    def _content_events(self, text: str, calls: list[dict]) -> list[bytes]:
        """A chunk's text (into the open text block, or a new one) and its calls, each
        a tool_use block of its own."""
        out = []
        if text:
            if self._open != "text":
                out += [self._close(), self._start({"type": "text", "text": ""})]
            out.append(event({"type": "content_block_delta", "index": self._blocks - 1,
                              "delta": {"type": "text_delta", "text": text}}))
        for call in calls:
            block = anthropic_tool_use(call)
            out += [self._close(), self._start({**block, "input": {}}),
                    event({"type": "content_block_delta", "index": self._blocks - 1,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": call["arguments"]}})]
        return [piece for piece in out if piece]

    def _close(self) -> bytes:
        """The stop event of the block being streamed (none if none is open)."""
        if self._open is None:
            return b""
        self._open = None
        return event({"type": "content_block_stop", "index": self._blocks - 1})

    def _start(self, block: dict) -> bytes:
        self._open = block["type"]
        self._blocks += 1
        return event({"type": "content_block_start", "index": self._blocks - 1,
                      "content_block": block})

    def _message(self, content: list) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.api.model_name}

    def _stop(self, choice: Choice) -> dict:
        """Anthropic's stop_reason, and the stop sequence that ended the text if one did."""
        if choice.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if choice.finish_reason == "tool_calls":
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if self.stop_sequences:
            # the text was cut at the first stop sequence in it (found in the raw text:
            # the sent text may be parsed into thinking, answer and calls)
            raw = self.api.codec.decode(choice.token_ids)
            hits = [(raw.find(s), s) for s in self.stop_sequences if s in raw]
            if hits:
                return {"stop_reason": "stop_sequence", "stop_sequence": min(hits)[1]}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _usage(self) -> dict:
        usage = self.outputs.usage()
        return {**_input_usage({"prompt_tokens": usage["prompt_tokens"], "cached_tokens":
                                usage["prompt_tokens_details"]["cached_tokens"]}),
                "output_tokens": usage["completion_tokens"]}


def _input_usage(usage: dict | None) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart."""
    prompt, cached = (usage["prompt_tokens"], usage.get("cached_tokens", 0)) if usage \
        else (0, 0)
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached}

