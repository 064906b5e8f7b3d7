"""A call's chunks grouped into choices, its usage, and logprobs in OpenAI's forms.

Request i of a call (the i-th of `rids`) with n choices makes choices i*n .. i*n+n-1;
a chunk says which of its request's choices it belongs to by its `index` (0 without
one)."""

from dataclasses import dataclass, field
from typing import Callable

from mlxd.protocol import StreamChunk

TokenText = Callable[[int], str]


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    seen: bool = False   # a chunk of it was sent (streaming: the first carries the role)
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # StreamChunk.tool_calls'


class Outputs:
    def __init__(self, rids: list[str], n: int = 1, echo: list[str] | None = None):
        self.order = {rid: i for i, rid in enumerate(rids)}   # a request's place in the call
        self.n = n
        self.echo = echo            # per request: text put before its choices' output
        self.choices: dict[int, Choice] = {}
        self._usage: dict[tuple[str, int], dict] = {}   # (rid, index) -> its final usage

    def add(self, chunk: StreamChunk) -> tuple[Choice, str]:
        """Record a chunk; returns its choice and the text it adds (the echoed prompt
        comes before a choice's first text)."""
        which, request = chunk.index, self.order[chunk.rid]
        index = request * self.n + which
        choice = self.choices.get(index)
        text = chunk.text
        if choice is None:
            choice = self.choices[index] = Choice(index)
            if self.echo is not None:
                text = self.echo[request] + text
        choice.text += text
        choice.reasoning += chunk.reasoning or ""
        choice.tool_calls += chunk.tool_calls or []
        choice.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            choice.logprobs += chunk.logprobs
            choice.top_logprobs += chunk.top_logprobs or [None] * len(chunk.token_ids)
        if chunk.finish_reason:
            choice.finish_reason, choice.error = chunk.finish_reason, chunk.error
            if chunk.usage is not None:
                self._usage[chunk.rid, which] = chunk.usage
        return choice, text

    def in_order(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]

    def usage(self) -> dict:
        """OpenAI's usage: each request's prompt counted once, every choice's output."""
        prompts = {rid: u for (rid, _), u in self._usage.items()}
        prompt = sum(u["prompt_tokens"] for u in prompts.values())
        completion = sum(u["completion_tokens"] for u in self._usage.values())
        cached = sum(u.get("cached_tokens", 0) for u in prompts.values())
        disk = sum(u.get("disk_tokens", 0) for u in prompts.values())
        details = {"cached_tokens": cached}
        if disk:   # of cached_tokens, read from the disk tier (--kv-disk)
            details["disk_cached_tokens"] = disk
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": details}


def _candidate(token_text: TokenText, token: int, logprob: float) -> dict:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(token_text: TokenText, ids: list[int], logprobs: list[float],
                  tops: list) -> dict:
    """Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    content = []
    for i, (token, logprob) in enumerate(zip(ids, logprobs)):
        top = tops[i] if i < len(tops) and tops[i] else [[], []]
        content.append({**_candidate(token_text, token, logprob), "top_logprobs": [
            _candidate(token_text, t, lp) for t, lp in zip(*top)]})
    return {"content": content}


def completion_logprobs(token_text: TokenText, ids: list[int], logprobs: list[float],
                        tops: list, offset: int) -> dict:
    """The completions API's legacy `logprobs` object; `offset`: where the choice's
    generated text starts in its `text`."""
    tokens = [token_text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [None if not (i < len(tops) and tops[i]) else
           {token_text(t): lp for t, lp in zip(*tops[i])} for i in range(len(ids))]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top,
            "text_offset": offsets}
