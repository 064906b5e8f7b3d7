"""Server-sent events: OpenAI's `data:` lines ending in `[DONE]`, and Anthropic's
named events."""

import json

DONE = b"data: [DONE]\n\n"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data(obj) -> bytes:
    """One OpenAI event."""
    return f"data: {dumps(obj)}\n\n".encode()


def event(obj: dict) -> bytes:
    """One Anthropic event, named by its `type`."""
    return f"event: {obj['type']}\ndata: {dumps(obj)}\n\n".encode()
