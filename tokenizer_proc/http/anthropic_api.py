"""`POST /v1/messages`, Anthropic's Messages API: text and tool calls in and out,
streamed as its named events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop); a tool call is a `tool_use` block whose input comes
as one `input_json_delta`. `POST /v1/messages/count_tokens` counts a request's
prompt as it would be rendered. A final assistant message is a prefill: the reply
continues it. A `cache_control` breakpoint pins the prompt's prefix up to its block
in the prefix cache for its TTL (the core's `cache_prefixes`)."""

import asyncio
import re
import uuid
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from mlxd.protocol import MAX_PINS, ErrorReply, GenerateRequest

from ..params import InvalidRequest
from .access_log import access_note
from .anthropic_schema import (
    PASSED, CacheControl, CountTokensRequest, Message, MessagesRequest, TextBlock, Tool,
    ToolResultBlock, ToolUseBlock,
)
from .choices import Choice, Outputs
from .compat import MESSAGES
from .context import Api, read_body
from .errors import ApiError, anthropic_body, bad_request
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
TTL_SECONDS = {"5m": 300, "1h": 3600}
# Rendered after the last tool a breakpoint covers, so that its prefix ends where that
# tool does, whatever the template writes after the tools.
MARK_TOOL = Tool(name="_", input_schema={"type": "object", "properties": {}})
EMPTY_TURN = Message(role="user", content="")   # ends a prefix that has no turn


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
    for name in ("enable_thinking", "thinking_budget", "response_format"):
        if getattr(body, name) is not None:
            params[name] = getattr(body, name)
    if prefilled(body):
        params["continue_final_message"] = True
    prefixes = cache_prefixes(body)
    if prefixes:
        params["cache_prefixes"] = prefixes
    return {**params, **anthropic_tool_params(body.tools, body.tool_choice)}


def cache_prefixes(body: MessagesRequest) -> list[dict]:
    """Each cache_control breakpoint (at most 4, as Anthropic allows) as the chat that
    renders the prompt up to its block, in Anthropic's order (tools, system, messages),
    with its TTL; the core finds where each ends in the prompt's tokens."""
    found = list(_breakpoints(body))
    if len(found) > MAX_PINS:
        raise bad_request(f"A maximum of {MAX_PINS} blocks with cache_control may be "
                          f"provided. Found {len(found)}.")
    return [{**_prefix(body, where), "ttl": TTL_SECONDS[control.ttl]}
            for where, control in found]


def _breakpoints(body: MessagesRequest):
    """(where, cache_control) of each block with one: ("tool", i), ("system", j) or
    ("message", k, b); a block inside a tool result counts as that result."""
    for i, tool in enumerate(body.tools or []):
        if tool.cache_control:
            yield ("tool", i), tool.cache_control
    for j, block in enumerate([] if isinstance(body.system, str | None) else body.system):
        if block.cache_control:
            yield ("system", j), block.cache_control
    for k, m in enumerate(body.messages):
        for b, block in enumerate([] if isinstance(m.content, str) else m.content):
            if control := block.cache_control or _inner_control(block):
                yield ("message", k, b), control


def _inner_control(block) -> CacheControl | None:
    inner = block.content if isinstance(block, ToolResultBlock) else ""
    controls = [] if isinstance(inner, str) else [b.cache_control for b in inner
                                                  if b.cache_control]
    return controls[-1] if controls else None


def _prefix(body: MessagesRequest, where: tuple) -> dict:
    """The core's cache prefix of a breakpoint: the body cut after its block."""
    system_turns = [m for m in body.messages if m.role == "system"]
    if where[0] == "tool":
        cut = body.model_copy(update={"messages": system_turns + [EMPTY_TURN]})
        tools = body.tools[:where[1] + 1] + [MARK_TOOL]
        return {"messages": chat_messages(cut),
                "tools": anthropic_tool_params(tools, None)["tools"]}
    if where[0] == "system":
        cut = body.model_copy(update={"system": body.system[:where[1] + 1],
                                      "messages": [EMPTY_TURN]})
        return {"messages": chat_messages(cut)}
    k, b = where[1:]
    last = body.messages[k].model_copy(update={"content": body.messages[k].content[:b + 1]})
    turns = body.messages[:k] + [last] + ([EMPTY_TURN] if last.role == "system" else [])
    return {"messages": chat_messages(body.model_copy(update={"messages": turns}))}


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
    def apply(body: dict) -> dict:
        check_cache_controls(body)
        return api.compat.apply(MESSAGES, body)
    return apply


def check_cache_controls(body: dict) -> None:
    """A bad cache_control is a 400 naming it, in Anthropic's words (the body's model
    would blame the union around its block: `system: Input should be a valid string`)."""
    for path, control in _controls(body):
        try:
            CacheControl.model_validate(control)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, (*path, "cache_control", *first["loc"])))
            why = ("this server does not support the parameter"
                   if first["type"] == "extra_forbidden" else first["msg"])
            raise bad_request(f"{where}: {why}", where) from None


def _controls(body: dict):
    """(path, value) of every cache_control in the raw body: on tools, system blocks,
    message content blocks and the blocks of a tool result."""
    def blocks(path: tuple, value):
        for i, block in enumerate(value if isinstance(value, list) else []):
            if isinstance(block, dict):
                if "cache_control" in block:
                    yield (*path, i), block["cache_control"]
                yield from blocks((*path, i, "content"), block.get("content"))

    yield from blocks(("tools",), body.get("tools"))
    yield from blocks(("system",), body.get("system"))
    for k, m in enumerate(body.get("messages") if isinstance(body.get("messages"), list)
                          else []):
        if isinstance(m, dict):
            yield from blocks(("messages", k, "content"), m.get("content"))


async def messages(api: Api, request: Request):
    body = await read_body(request, MessagesRequest, _policy(api))
    api = await api.for_model(body.model)
    api.check_ready()
    params = core_params(body)
    gen = Generation(api.front, api.metrics, anthropic_error, access_note(request))
    requests = generate_requests([{"messages": chat_messages(body)}], params, body.stream)
    await gen.begin(requests, request.receive)
    render = MessageRender(api, [r.rid for r in requests], body.stop_sequences or [],
                           gen.call.usage_so_far, thinking=bool(body.enable_thinking))
    return await respond(gen, body.stream, render.response, render.events)


async def count_tokens(api: Api, request: Request):
    """`{"input_tokens": N}`: the prompt a request of this body would have (its
    template, tools and system prompt), counted without running it."""
    body = await read_body(request, CountTokensRequest, _policy(api))
    api = await api.for_model(body.model)
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
                 usage_so_far: Callable[[str], dict | None] = lambda rid: None,
                 thinking: bool = False):
        """`thinking`: the request turned thinking on, and gets the model's thinking
        as `thinking` blocks (else it is left out, as Anthropic leaves it)."""
        self.api = api
        self.thinking = thinking
        self.usage_so_far = usage_so_far   # a running request's usage, by rid
        self.stop_sequences = stop_sequences
        self.outputs = Outputs(rids)
        self.id = f"msg_{uuid.uuid4().hex}"
        self._blocks = 0          # content blocks started while streaming
        self._final_usage: dict | None = None   # the scheduler's, with the finish
        self._open: str | None = None   # the kind of the block being streamed

    async def response(self, chunks) -> dict:
        async for chunk in chunks:
            choice, _ = self._add(chunk)
            if failed(chunk):
                raise failed(chunk)
        thought = [_thinking_block(choice.reasoning)] \
            if self.thinking and choice.reasoning else []
        text = [{"type": "text", "text": choice.text}] \
            if choice.text or not (choice.tool_calls or thought) else []
        content = thought + text + [anthropic_tool_use(call) for call in choice.tool_calls]
        return {**self._message(content), **self._stop(choice), "usage": self._usage()}

    async def events(self, chunks) -> AsyncIterator[bytes]:
        started = False
        try:
            async for chunk in chunks:
                choice, text = self._add(chunk)
                if failed(chunk):
                    raise failed(chunk)
                if not started:
                    usage = chunk.usage or self.usage_so_far(chunk.rid)
                    yield event({"type": "message_start", "message": {
                        **self._message([]), "stop_reason": None, "stop_sequence": None,
                        "usage": {**_input_usage(usage), "output_tokens": 0}}})
                    started = True
                reasoning = chunk.reasoning if self.thinking else None
                for piece in self._content_events(text, chunk.tool_calls or [], reasoning):
                    yield piece
            if self._blocks == 0:   # nothing at all: one empty text block
                yield self._start({"type": "text", "text": ""})
            yield self._close()   # there is an open block: the last one started
            yield event({"type": "message_delta", "delta": self._stop(choice),
                         "usage": self._usage()})
            yield event({"type": "message_stop"})
        except ApiError as exc:
            yield event(anthropic_body(exc))

    def _add(self, chunk):
        if chunk.finish_reason and chunk.usage:
            self._final_usage = chunk.usage
        return self.outputs.add(chunk)

    def _content_events(self, text: str, calls: list[dict],
                        reasoning: str | None = None) -> list[bytes]:
        """A chunk's thinking and text (each into the open block of its kind, or a new
        one) and its calls, each a tool_use block of its own."""
        out = []
        if reasoning:
            if self._open != "thinking":
                out += [self._close(), self._start(_thinking_block(""))]
            out.append(event({"type": "content_block_delta", "index": self._blocks - 1,
                              "delta": {"type": "thinking_delta", "thinking": reasoning}}))
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
        return {**_input_usage(self._final_usage),
                "output_tokens": self.outputs.usage()["completion_tokens"]}


def _thinking_block(text: str) -> dict:
    """A thinking block; its signature is empty (nothing here signs the thinking, and
    a thinking block sent back in history is accepted as it is)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _input_usage(usage: dict | None) -> dict:
    """Anthropic counts apart the prompt tokens read from the cache and those written
    to it (computed and pinned by cache_control); input_tokens are the rest."""
    usage = usage or {}
    prompt, cached = usage.get("prompt_tokens", 0), usage.get("cached_tokens", 0)
    pinned = usage.get("pinned_tokens", 0)
    return {"input_tokens": prompt - cached - pinned,
            "cache_creation_input_tokens": pinned, "cache_read_input_tokens": cached}

