"""A call's chunks as a Responses API response: its output items and its stream events.

The items come in the order the model wrote them: a `reasoning` item for the thinking
(its text as one `reasoning_text` part), a `message` item for the answer (one
`output_text` part), a `function_call` item per tool call (whole: the core passes a
call on when it is complete, so its arguments come in one delta). The events, each
with its `sequence_number`:

    response.created, response.in_progress
    per reasoning or message item: response.output_item.added,
        response.content_part.added, response.reasoning_text.delta* or
        response.output_text.delta*, their .done, response.content_part.done,
        response.output_item.done
    per call: response.output_item.added, response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, response.failed
        on an error, or when cancelled: its status says which)

A response that is not streamed is built by the same steps, its events dropped, so
both ways give the same output."""

import time
import uuid
from typing import AsyncIterator, Callable

from mlxd.protocol import StreamChunk

from .calls import Cancelled
from .choices import Outputs, TokenText, chat_logprobs
from .errors import ApiError
from .generation import failed
from .sse import event

# per streamed item kind: its part's type, its delta event's name, its id's prefix
PARTS = {"reasoning": ("reasoning_text", "response.reasoning_text", "rs"),
         "message": ("output_text", "response.output_text", "msg")}


class ResponseRender:
    def __init__(self, token_text: TokenText, head: dict, rids: list[str], logprobs: bool):
        self.token_text, self.head, self.logprobs = token_text, head, logprobs
        self.outputs = Outputs(rids)
        self.output: list[dict] = []
        self.on_end: Callable[[dict | None], None] = lambda response: None
        self.error: ApiError | None = None
        self._final: dict = {}
        self._open: dict | None = None   # the reasoning or message item being streamed
        self._seq = 0

    def snapshot(self, status: str, **fields) -> dict:
        return {**self.head, "status": status, "output": self.output, **fields}

    async def response(self, chunks) -> dict:
        """The whole response (an error raised as ApiError, as chat's)."""
        async for _ in self.events(chunks):
            pass
        if self.error is not None:
            raise self.error
        return self._final

    async def events(self, chunks) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self.snapshot("in_progress"))
        yield self._event("response.in_progress", response=self.snapshot("in_progress"))
        finish = None
        try:
            async for chunk in chunks:
                for piece in self._on_chunk(chunk):
                    yield piece
                finish = chunk.finish_reason or finish
            status = "incomplete" if finish == "length" else "completed"
        except Cancelled:
            status = "cancelled"
        except ApiError as exc:   # refused or failed after the stream began
            self.error, status = exc, "failed"
        except BaseException:     # the client went away
            self.on_end(None)
            raise
        for piece in self._finish(status):
            yield piece

    def _on_chunk(self, chunk: StreamChunk) -> list[bytes]:
        error = failed(chunk)
        if error:
            raise error
        _, text = self.outputs.add(chunk)
        out = []
        if chunk.reasoning:
            out += self._stream("reasoning", chunk.reasoning)
        if text:
            out += self._stream("message", text, self._logprobs(chunk))
        for call in chunk.tool_calls or ():
            out += self._close("completed") + self._call(call)
        return out

    def _stream(self, kind: str, text: str, logprobs: list | None = None) -> list[bytes]:
        """Text into the open item of its kind (opened first if another is open)."""
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self._close("completed") + self._start(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        delta = {"delta": text}
        if kind == "message":
            part["logprobs"] += logprobs or []
            delta["logprobs"] = logprobs or []
        return out + [self._event(PARTS[kind][1] + ".delta", **self._where(item), **delta)]

    def _start(self, kind: str) -> list[bytes]:
        part_type, _, prefix = PARTS[kind]
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress"}
        part = {"type": part_type, "text": ""}
        if kind == "message":
            item["role"] = "assistant"
            part.update(annotations=[], logprobs=[])
        else:
            item["summary"] = []
        out = [self._event("response.output_item.added", output_index=len(self.output),
                           item={**item, "content": []})]
        item["content"] = [part]
        self.output.append(item)
        self._open = item
        return out + [self._event("response.content_part.added", **self._where(item),
                                  part=part)]

    def _close(self, status: str) -> list[bytes]:
        """The done events of the open item, if one is."""
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = status
        part = item["content"][0]
        done = {"text": part["text"]}
        if item["type"] == "message":
            done["logprobs"] = part["logprobs"]
        return [self._event(PARTS[item["type"]][1] + ".done", **self._where(item), **done),
                self._event("response.content_part.done", **self._where(item), part=part),
                self._event("response.output_item.done", output_index=self._index(item),
                            item=item)]

    def _call(self, call: dict) -> list[bytes]:
        """One tool call, whole: added, its arguments in one delta, done."""
        item = {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
                "status": "in_progress", "call_id": call["id"], "name": call["name"],
                "arguments": ""}
        out = [self._event("response.output_item.added", output_index=len(self.output),
                           item=dict(item))]
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": self._index(item)}
        item.update(arguments=call["arguments"], status="completed")
        return out + [
            self._event("response.function_call_arguments.delta", **where,
                        delta=call["arguments"]),
            self._event("response.function_call_arguments.done", **where,
                        name=call["name"], arguments=call["arguments"]),
            self._event("response.output_item.done", output_index=where["output_index"],
                        item=item)]

    def _finish(self, status: str) -> list[bytes]:
        """Close what is open, keep the final response (on_end), then its terminal event."""
        out = self._close("incomplete" if status != "completed" else "completed")
        if not self.output and status in ("completed", "incomplete"):
            out += self._start("message") + self._close(
                "completed" if status == "completed" else "incomplete")
        fields: dict = {"usage": self._usage()}
        if status == "incomplete":
            fields["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.error is not None:
            fields["error"] = {"code": "server_error", "message": self.error.message}
        self._final = self.snapshot(status, **fields, completed_at=int(time.time()))
        self.on_end(self._final)
        name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed")
        return out + [self._event(name, response=self._final)]

    def _usage(self) -> dict:
        usage = self.outputs.usage()
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}

    def _logprobs(self, chunk: StreamChunk) -> list | None:
        if not self.logprobs or chunk.logprobs is None:
            return None
        return chat_logprobs(self.token_text, chunk.token_ids, chunk.logprobs,
                             chunk.top_logprobs or [])["content"]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.output) if it is item)

    def _event(self, kind: str, **fields) -> bytes:
        self._seq += 1
        return event({"type": kind, "sequence_number": self._seq - 1, **fields})
