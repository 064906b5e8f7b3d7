"""The OpenAI- and Anthropic-compatible HTTP API of the tokenizer process
(docs/ARCHITECTURE.md, "HTTP front end")."""

from .server import HttpFrontEnd

__all__ = ["HttpFrontEnd"]
