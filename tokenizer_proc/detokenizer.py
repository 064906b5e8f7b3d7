"""Incremental detokenization: text deltas that never split a UTF-8 character.

Each call decodes a short window of recent tokens twice (with and without the
new ones) and emits the difference, so tokenizers whose decoding depends on
neighbouring tokens (leading spaces, byte fallback) stream exactly what a full
decode would produce.
"""

from typing import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.tokens: list[int] = []
        self._prefix_offset = 0   # start of the window decoded for context
        self._read_offset = 0     # tokens before this are already emitted

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new, complete text (possibly empty)."""
        self.tokens += token_ids
        prefix = self._decode(self.tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""   # an incomplete character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        return full[len(prefix):]

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, decoded whole."""
        return self._decode(token_ids)

    def flush(self) -> str:
        """At the end of a request: whatever is still held back, even if incomplete."""
        prefix = self._decode(self.tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.tokens)
        return full[len(prefix):] if len(full) > len(prefix) else ""
