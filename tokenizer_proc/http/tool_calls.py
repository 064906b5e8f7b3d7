"""Tool calls and reasoning between the HTTP APIs' shapes and the core's: the
tool options a body sends (params), and the calls a reply carries (StreamChunk
`tool_calls`: {index, id, name, arguments}) in OpenAI's and Anthropic's forms."""

import json


def openai_tool_params(body) -> dict:
    """The core's params for an OpenAI chat body's tools and template options."""
    params = {}
    if body.tools is not None:
        params["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        params["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
    for name in ("parallel_tool_calls", "chat_template_kwargs", "enable_thinking"):
        if getattr(body, name) is not None:
            params[name] = getattr(body, name)
    return params


def openai_call(call: dict, with_index: bool = False) -> dict:
    """A call as OpenAI's `tool_calls` entry (a stream delta carries its `index`)."""
    out = {"index": call["index"]} if with_index else {}
    return {**out, "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}


def anthropic_tool_use(call: dict) -> dict:
    """A call as Anthropic's `tool_use` content block."""
    return {"type": "tool_use", "id": anthropic_id(call["id"]), "name": call["name"],
            "input": json.loads(call["arguments"])}


def anthropic_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def anthropic_tool_params(tools, tool_choice) -> dict:
    """The core's params for an Anthropic body's `tools` and `tool_choice`."""
    params = {}
    if tools is not None:
        params["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description else {})}} for t in tools]
    if tool_choice is not None:
        kind = tool_choice.type
        params["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            kind) or {"type": "function", "function": {"name": tool_choice.name}}
        if tool_choice.disable_parallel_tool_use:
            params["parallel_tool_calls"] = False
    return params
