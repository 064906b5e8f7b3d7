"""Chat messages as chat templates expect them, tool calls and tool results included:
OpenAI sends a call's arguments as JSON text, templates read them as an object."""

import json

from .request import InvalidOptions

SHAPE = ("messages must be a list of {role: str, content: str}; an assistant message "
         "may carry tool_calls instead of content")


def _arguments(call):
    """A call with its `function.arguments` as an object where they are JSON text."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidOptions("tool_calls must be a list of {id, type, function: "
                             "{name, arguments}}")
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass   # the template gets the text as it was sent
    return {**call, "function": {**call["function"], "arguments": arguments}}


def template_message(message) -> dict:
    """One message, checked; content None (an assistant's pure tool call) as ""."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidOptions(SHAPE)
    calls = message.get("tool_calls")
    content = message.get("content")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise InvalidOptions(SHAPE)
    if calls is None:
        return {**message, "content": content}
    if not isinstance(calls, list):
        raise InvalidOptions("tool_calls must be a list")
    return {**message, "content": content, "tool_calls": [_arguments(c) for c in calls]}
