"""Driving one trace on one system: requests sent at their arrival times (or
turn after turn in chat sessions), each timed from send to its last reply, none
allowed to hang: a request that fails or times out is recorded as an error and
the run goes on."""

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from bench.serving.metrics import RequestRecord
from bench.serving.systems import Final, PromptCodecs
from bench.serving.traces import Trace, TraceRequest

now = time.perf_counter


@dataclass
class PromptCheck:
    """Did both servers' tokenizer code encode each prompt to the same ids, and
    to as many tokens as the trace drew?"""

    checked: int = 0
    identical: int = 0
    drawn_mismatches: int = 0

    def add(self, ids: dict[str, list[int]], drawn: int | None = None) -> None:
        self.checked += 1
        self.identical += ids["mlxd"] == ids["mlx_lm"]
        if drawn is not None:
            self.drawn_mismatches += len(ids["mlxd"]) != drawn


@dataclass
class RunContext:
    system: str                          # "mlxd" or "mlx_lm"
    driver: object                       # its MlxdDriver / MlxLmDriver
    codecs: PromptCodecs
    timeout: float                       # per request, send to last reply
    alive: Callable[[], bool]            # is the server process still running?
    on_done: Callable[[RequestRecord], None] = lambda record: None
    start: float = 0.0
    prompts: PromptCheck = field(default_factory=PromptCheck)


async def run_trace(ctx: RunContext, trace: Trace) -> list[RequestRecord]:
    """All of the trace's requests; the clock starts here."""
    ctx.prompts = PromptCheck()
    if trace.kind == "multiturn":
        ctx.start = now()
        sessions = await asyncio.gather(*(run_session(ctx, turns) for turns in trace.sessions()))
        return [record for session in sessions for record in session]
    expected = {}
    for req in trace.requests:     # encoded before the clock starts
        ids = ctx.codecs.text_ids(req.prompt)
        ctx.prompts.add(ids, req.prompt_tokens)
        expected[req.id] = len(ids[ctx.system])
    ctx.start = now()
    return list(await asyncio.gather(*(run_one(ctx, req, expected[req.id])
                                       for req in trace.requests)))


async def run_one(ctx: RunContext, req: TraceRequest, expected_prompt: int) -> RequestRecord:
    await _sleep_until(ctx.start + req.arrival)
    record = RequestRecord(req.id, now() - ctx.start, req.output_tokens, expected_prompt)
    return await measure(ctx, record, prompt=req.prompt, max_tokens=req.output_tokens)


class Conversation:
    """One session's growing prompt: chat messages when the model has a chat
    template, else plain text (prompt + answer + next user message)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.chat = ctx.codecs.has_chat_template
        self.messages: list[dict] = []
        self.prompt = ""

    def ask(self, user: str) -> tuple[dict, int]:
        """The request for the next turn and its prompt length for this system."""
        if self.chat:
            self.messages.append({"role": "user", "content": user})
            ids = self.ctx.codecs.chat_ids(self.messages)
            request = {"messages": [dict(m) for m in self.messages]}
        else:
            self.prompt = f"{self.prompt} {user}" if self.prompt else user
            ids = self.ctx.codecs.text_ids(self.prompt)
            request = {"prompt": self.prompt}
        self.ctx.prompts.add(ids)
        return request, len(ids[self.ctx.system])

    def answer(self, text: str) -> None:
        if self.chat:
            self.messages.append({"role": "assistant", "content": text})
        else:
            self.prompt += text


async def run_session(ctx: RunContext, turns: list[TraceRequest]) -> list[RequestRecord]:
    await _sleep_until(ctx.start + turns[0].arrival)
    conversation, records, failed = Conversation(ctx), [], None
    for req in turns:
        if failed is not None:
            record = RequestRecord(req.id, now() - ctx.start, req.output_tokens,
                                   error=f"skipped: turn {failed} of the session failed")
            ctx.on_done(record)
            records.append(record)
            continue
        request, expected = conversation.ask(req.user)
        record = RequestRecord(req.id, now() - ctx.start, req.output_tokens, expected)
        records.append(await measure(ctx, record, max_tokens=req.output_tokens, **request))
        if record.ok:
            conversation.answer(record.text)
        else:
            failed = req.id
    return records


async def measure(ctx: RunContext, record: RequestRecord, **request) -> RequestRecord:
    """Send one request and time its stream into `record`; never raises."""
    if not ctx.alive():
        record.error = "the server is not running"
    else:
        try:
            await asyncio.wait_for(_consume(ctx, record, ctx.driver.stream(**request)),
                                   ctx.timeout)
        except asyncio.TimeoutError:
            record.error = f"no complete reply within {ctx.timeout:g} s"
        except Exception as exc:    # connection lost, HTTP error, rejected request...
            record.error = f"{type(exc).__name__}: {exc}"
        if record.error is not None:
            record.failed = now() - ctx.start
    record.check()
    ctx.on_done(record)
    return record


async def _consume(ctx: RunContext, record: RequestRecord, stream) -> None:
    async for item in stream:
        t = now() - ctx.start
        if isinstance(item, Final):
            record.done = t
            record.finish_reason = item.finish_reason
            record.prompt_tokens, record.output_tokens = item.prompt_tokens, item.output_tokens
            record.cached_tokens = item.cached_tokens
            record.retries = item.retries
            if item.error or item.finish_reason == "error":
                record.error = f"server error: {item.error}"
            continue
        record.text += item.text
        if item.tokens != 0:
            record.chunk_times.append(t)
            record.chunk_tokens.append(item.tokens)
    if record.done is None:
        raise RuntimeError("the stream ended without a final reply")


async def warm_up(driver, prompt: str, timeout: float) -> None:
    """One short request, untimed: loads the model (mlx_lm.server loads it on
    its generation thread) and warms both servers' first-step paths."""
    async def run():
        async for item in driver.stream(prompt=prompt, max_tokens=4):
            if isinstance(item, Final) and item.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"warm-up request failed: {item.finish_reason} {item.error}")

    await asyncio.wait_for(run(), timeout)


async def _sleep_until(deadline: float) -> None:
    delay = deadline - now()
    if delay > 0:
        await asyncio.sleep(delay)
