"""`POST /v1/messages`, Anthropic's Messages API: text in, text out, streamed as its
named events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop)."""

import uuid
from typing import AsyncIterator

from fastapi import Request

from .anthropic_schema import MessagesRequest, TextBlock
from .choices import Choice, Outputs
from .context import Api, read_body
from .errors import ApiError, anthropic_body
from .generation import Generation, failed
from .openai_api import respond
from .requests import core_error, generate_requests
from .sse import event

RENAMED = {"stop": "stop_sequences", "prompt": "messages", "input_ids": "messages"}


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(body: MessagesRequest) -> list[dict]:
    system = [{"role": "system", "content": _text(body.system)}] if body.system else []
    return system + [{"role": m.role, "content": _text(m.content)} for m in body.messages]


def core_params(body: MessagesRequest) -> dict:
    params = {"max_tokens": body.max_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    return {k: v for k, v in params.items() if v is not None}


async def messages(api: Api, request: Request):
    body = await read_body(request, MessagesRequest)
    api.check_model(body.model)
    api.check_ready()
    params = core_params(body)
    gen = Generation(api.front, api.metrics, lambda e: core_error(e, params, RENAMED))
    requests = generate_requests([{"messages": chat_messages(body)}], params, body.stream)
    await gen.begin(requests, request.receive)
    render = MessageRender(api, body.stop_sequences or [])
    return await respond(gen, body.stream, render.response, render.events)


class MessageRender:
    def __init__(self, api: Api, stop_sequences: list[str]):
        self.api = api
        self.stop_sequences = stop_sequences
        self.outputs = Outputs()
        self.id = f"msg_{uuid.uuid4().hex}"

    async def response(self, chunks) -> dict:
        async for chunk in chunks:
            choice, _ = self.outputs.add(chunk)
            if failed(chunk):
                raise failed(chunk)
        return {**self._message([{"type": "text", "text": choice.text}]),
                **self._stop(choice), "usage": self._usage()}

    async def events(self, chunks) -> AsyncIterator[bytes]:
        started = False
        try:
            async for chunk in chunks:
                choice, text = self.outputs.add(chunk)
                if failed(chunk):
                    raise failed(chunk)
                if not started:
                    yield event({"type": "message_start", "message": {
                        **self._message([]), "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": 0, "output_tokens": 0}}})
                    yield event({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})
                    started = True
                if text:
                    yield event({"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}})
            yield event({"type": "content_block_stop", "index": 0})
            yield event({"type": "message_delta", "delta": self._stop(choice),
                         "usage": self._usage()})
            yield event({"type": "message_stop"})
        except ApiError as exc:
            yield event(anthropic_body(exc))

    def _message(self, content: list) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.api.model_name}

    def _stop(self, choice: Choice) -> dict:
        """Anthropic's stop_reason, and the stop sequence that ended the text if one did."""
        if choice.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if self.stop_sequences:
            rest = self.api.codec.decode(choice.token_ids)[len(choice.text):]
            hit = next((s for s in self.stop_sequences if rest.startswith(s)), None)
            if hit is not None:
                return {"stop_reason": "stop_sequence", "stop_sequence": hit}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _usage(self) -> dict:
        """Anthropic counts the prompt tokens read from the cache apart."""
        usage = self.outputs.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"] - cached,
                "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached}
