"""Per-request output state in the tokenizer: detokenization, stop strings, chunks.

Text that could be the start of a stop string is held back until it is known
not to be one, so a stop string never reaches the client, even in a stream.
With an output parser, the text past the stop strings is split into answer,
reasoning and tool calls (tools/output.py) before it is sent.
"""

from mlxd.protocol import StreamChunk, TokenEntry, Usage

from .detokenizer import IncrementalDetokenizer
from .tools.output import Delta, OutputParser


class RequestStream:
    def __init__(self, client_rid: str, rid: int, detokenizer: IncrementalDetokenizer,
                 stop: list[str], stream: bool, logprobs: bool, index: int = 0,
                 parser: OutputParser | None = None):
        self.client_rid = client_rid
        self.parser = parser
        self.rid = rid
        self.index = index   # the choice this is, of a request with n > 1
        self.detokenizer = detokenizer
        self.stop = stop
        self.stream = stream
        self.want_logprobs = logprobs
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None   # the scheduler's latest (sent with the first token)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._searched = 0      # text before this was checked for stop strings
        self._sent_text = 0     # chunk cursors
        self._sent_tokens = 0
        self._stopped_early = False   # a stop string ended it before the scheduler did
        self._stop_end = 0            # where the stop string that cut the text ended

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_entry(self, entry: TokenEntry) -> StreamChunk | None:
        """Take the scheduler's new tokens; return a chunk to send, if any.
        After a stop-string hit `finish_reason` is "stop" and the scheduler
        still has to be told to abort the request; of an entry of several tokens
        (a verified draft's run), those after the one that completes the stop
        string are dropped, and not counted, as one token per entry would have."""
        if entry.usage is not None:
            self.usage = entry.usage
        self.token_ids += entry.token_ids
        self.logprobs += entry.logprobs
        self.top_logprobs += entry.top_logprobs or [None] * len(entry.token_ids)
        self.text += self.detokenizer.add(entry.token_ids)
        if entry.finish_reason:
            self.text += self.detokenizer.flush()
        if self._cut_at_stop_string():
            self.finish_reason = "stop"
            self._stopped_early = self._drop_tokens_past_stop(len(entry.token_ids)) or \
                not entry.finish_reason
        elif entry.finish_reason:
            self.finish_reason = entry.finish_reason
        return self._chunk(entry)

    def _drop_tokens_past_stop(self, new: int) -> bool:
        """Keep, of the `new` tokens just taken, the fewest whose text holds the whole
        stop string; whether any were dropped."""
        tokens = self.detokenizer.tokens
        base = len(self.token_ids) - new
        keep = next((m for m in range(1, new)
                     if len(self.detokenizer.decode(tokens[:base + m])) >= self._stop_end), new)
        if keep == new:
            return False
        del self.token_ids[base + keep:], self.logprobs[base + keep:]
        del self.top_logprobs[base + keep:]
        return True

    def _cut_at_stop_string(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self._searched - self._holdback)
        hits = [(i, i + len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop)
                if i >= 0]
        self._searched = len(self.text)
        if not hits:
            return False
        cut, self._stop_end = min(hits)
        self.text = self.text[:cut]
        return True

    def _chunk(self, entry: TokenEntry) -> StreamChunk | None:
        if not self.stream and not self.finished:
            return None
        end = len(self.text) if self.finished else max(
            self._sent_text, len(self.text) - self._holdback)
        start_text, start_tok = (self._sent_text, self._sent_tokens) if self.stream else (0, 0)
        chunk = StreamChunk(self.client_rid, self.text[start_text:end],
                            self.token_ids[start_tok:], index=self.index)
        if self.parser is not None:
            self._parse(chunk)
        if self.want_logprobs:
            chunk.logprobs = self.logprobs[start_tok:]
            tops = self.top_logprobs[start_tok:]
            chunk.top_logprobs = tops if any(t is not None for t in tops) else None
        self._sent_text, self._sent_tokens = end, len(self.token_ids)
        if self.finished:
            chunk.finish_reason = self.finish_reason
            if self.finish_reason == "stop" and self.parser and self.parser.calls:
                chunk.finish_reason = "tool_calls"
            usage = self._final_usage(entry)
            chunk.usage = None if usage is None else usage.as_dict()
            chunk.error = entry.error
        elif not (chunk.text or chunk.token_ids or chunk.reasoning or chunk.tool_calls):
            return None
        return chunk

    def _parse(self, chunk: StreamChunk) -> None:
        """Replace the chunk's text by what the parser makes of it."""
        called = self.parser.calls
        delta = self.parser.feed(chunk.text)
        if self.finished:
            last = self.parser.finish()
            delta = Delta(delta.content + last.content, delta.reasoning + last.reasoning,
                          delta.tool_calls + last.tool_calls)
        chunk.text = delta.content
        chunk.reasoning = delta.reasoning or None
        chunk.tool_calls = [call.as_wire(called + i)
                            for i, call in enumerate(delta.tool_calls)] or None

    def _final_usage(self, entry: TokenEntry) -> Usage | None:
        """The scheduler's, when it finished the request; after a stop string, its
        latest with the tokens passed on here."""
        if entry.finish_reason and not self._stopped_early:
            return entry.usage
        if self.usage is None:
            return None
        return self.usage.with_completion_tokens(len(self.token_ids))
