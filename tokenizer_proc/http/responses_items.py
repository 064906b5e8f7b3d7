"""From a Responses API body to the core's chat messages and parameters.

Input items become the chat template's messages as chat completions sends them: a
message's text parts joined (`developer` as `system`), the model's `function_call`
items an assistant's `tool_calls` (joined into the assistant message before them),
`function_call_output` items `tool` messages, reasoning items left out. Output items
(what the model said, kept for `previous_response_id`) go back the same way. Tools
are flat here (`{type, name, parameters}`) and nested in chat (`{type, function}`);
`text.format` is chat's `response_format`; `reasoning.effort` turns thinking on or,
at `none` and `minimal`, off, sets its budget as chat's `reasoning_effort` does, and
goes to templates that read it as `reasoning_effort`."""

from typing import Sequence

from .compat import effort_fields   # as chat's reasoning_effort
from .responses_schema import (
    LOGPROBS, AllowedTools, FunctionCallItem, FunctionCallOutputItem, InputText,
    JsonSchemaFormat, MessageItem, NamedFunction, ResponsesRequest,
)


def chat_messages(items: list, before: Sequence[dict] = ()) -> list[dict]:
    """Input items (models of responses_schema, or output items as dicts) as chat
    messages; `before`: the conversation they continue (its calls name tool results)."""
    messages: list[dict] = []
    names = {c["id"]: c["function"]["name"]   # call_id -> the function, for tool turns
             for m in before for c in m.get("tool_calls", ())}
    for item in items:
        kind = item["type"] if isinstance(item, dict) else item.type
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            call = _call(item)
            names[call["id"]] = call["function"]["name"]
            _assistant(messages)["tool_calls"].append(call)
        elif kind == "function_call_output":
            messages.append(_tool_result(item, names))
    return messages


def _message(item) -> dict:
    if isinstance(item, dict):   # an output item: only output_text parts
        return {"role": item["role"], "content": "".join(p.get("text", "")
                                                         for p in item["content"])}
    assert isinstance(item, MessageItem)
    content = item.content if isinstance(item.content, str) else "".join(
        p.text if isinstance(p, InputText) else p.refusal for p in item.content)
    return {"role": "system" if item.role == "developer" else item.role, "content": content}


def _call(item) -> dict:
    if isinstance(item, dict):
        call_id, name, arguments = item["call_id"], item["name"], item["arguments"]
    else:
        assert isinstance(item, FunctionCallItem)
        call_id, name, arguments = item.call_id, item.name, item.arguments
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _assistant(messages: list[dict]) -> dict:
    """The assistant message a call joins: the last message if the assistant's (and
    not yet answered by a tool turn), else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    messages[-1].setdefault("tool_calls", [])
    return messages[-1]


def _tool_result(item: FunctionCallOutputItem, names: dict[str, str]) -> dict:
    output = item.output if isinstance(item.output, str) else \
        "".join(p.text for p in item.output)
    message = {"role": "tool", "tool_call_id": item.call_id, "content": output}
    if item.call_id in names:
        message["name"] = names[item.call_id]
    return message


def input_items(body: ResponsesRequest) -> list:
    """The body's input as items: a text is one user message."""
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)] if body.input else []
    return list(body.input)


def tool_params(body: ResponsesRequest) -> dict:
    """The core's tool and template options (chat's names and shapes)."""
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True,
                                                           exclude={"type"})}
             for t in body.tools or ()]
    params: dict = {"tools": tools} if body.tools is not None else {}
    choice = body.tool_choice
    if isinstance(choice, AllowedTools):
        allowed = {t.name for t in choice.tools}
        params["tools"] = [t for t in tools if t["function"]["name"] in allowed]
        choice = choice.mode
    if isinstance(choice, NamedFunction):
        params["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        params["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        params["parallel_tool_calls"] = body.parallel_tool_calls
    kwargs = dict(body.chat_template_kwargs or {})
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        mapped = effort_fields(effort, {})
        params["enable_thinking"] = mapped["enable_thinking"]
        if "thinking_budget" in mapped:
            params["thinking_budget"] = mapped["thinking_budget"]
        kwargs.setdefault("reasoning_effort", effort)
    if kwargs or body.chat_template_kwargs is not None:
        params["chat_template_kwargs"] = kwargs
    return params


def response_format(body: ResponsesRequest) -> dict | None:
    """`text.format` as chat's response_format (the core checks and compiles it). It
    shapes the reply's text, so a forced call, whose reply is the call, drops it (as
    OpenAI takes both; the Agents SDK sends both when an agent with an output type
    must call a tool)."""
    form = body.text.format if body.text is not None else None
    if form is None or form.type == "text" or forces_call(body):
        return None
    if isinstance(form, JsonSchemaFormat):
        spec = {"name": form.name, "schema": form.schema_}
        spec.update({k: v for k, v in (("description", form.description),
                                        ("strict", form.strict)) if v is not None})
        return {"type": "json_schema", "json_schema": spec}
    return {"type": form.type}


def forces_call(body: ResponsesRequest) -> bool:
    choice = body.tool_choice
    if isinstance(choice, AllowedTools):
        choice = choice.mode
    return bool(body.tools) and (choice == "required" or isinstance(choice, NamedFunction))


def logprobs_asked(body: ResponsesRequest) -> bool:
    """Logprobs come with the text when `include` asks for them, or top_logprobs does."""
    return LOGPROBS in (body.include or ()) or bool(body.top_logprobs)
