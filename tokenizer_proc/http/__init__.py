"""The OpenAI- and Anthropic-compatible HTTP API of the tokenizer process
(docs/design/http.md)."""

from .server import HttpFrontEnd

__all__ = ["HttpFrontEnd"]
