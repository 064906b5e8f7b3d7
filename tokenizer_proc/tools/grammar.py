"""The grammar that makes a reply a tool call, in the model's own format: Lark in
llguidance's flavour, with `%json` for the calls (a tool's name as a constant, its
parameters' schema for the arguments). Sent as the request's
`response_format: {"type": "grammar", "grammar": ...}`."""

import json
from typing import Callable

from ..constraints import JSON_OPTIONS, closed_objects
from .request import ChatOptions


def quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# How a marker is written in the grammar: `<[id]>` for a special token (its text is
# not what the model emits), else the quoted text.
TokenRef = Callable[[str], str]
# A string parameter's value in the XML format and its closing tag, one terminal (the
# lexer is greedy: a separate value terminal would swallow the newline before the tag).
TEXT = r"TEXT: /[^<]*\n<\/parameter>\n/"
CLOSE_PARAMETER = "\n</parameter>\n"
CLOSE_FUNCTION = quoted("</function>\n")
NEWLINE = '"\\n"'   # a newline as a Lark string


def _function(tool: dict) -> dict:
    return tool["function"]


def _call_schema(tools: list[dict], arguments_key: str) -> dict:
    """A JSON object naming one of `tools` with arguments valid for it."""
    options = [{"type": "object",
                "properties": {"name": {"const": _function(t)["name"]},
                               arguments_key: _function(t)["parameters"]},
                "required": ["name", arguments_key], "additionalProperties": False}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json(schema: dict) -> str:
    """The schema embedded, with response_format's fixed JSON whitespace (a sampled
    model would otherwise spend its tokens on free whitespace) and its objects closed
    where it leaves them open (`closed_objects`)."""
    embedded = {**closed_objects(schema), "x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(embedded, ensure_ascii=False)


def _repeated(parallel: bool, separator: str) -> str:
    return f"start: call ({quoted(separator)} call)*" if parallel else "start: call"


def hermes(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    body = _json(_call_schema(tools, "arguments"))
    call = f"call: {ref('<tool_call>')} {NEWLINE} {body} {NEWLINE} {ref('</tool_call>')}"
    return "\n".join([_repeated(parallel, "\n"), call]) + "\n"


def llama3_json(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    call = f"call: {_json(_call_schema(tools, 'parameters'))}"
    return "\n".join([_repeated(parallel, "; "), call]) + "\n"


def mistral(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    calls = {"type": "array", "items": _call_schema(tools, "arguments"), "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return f"start: {ref('[TOOL_CALLS]')} {_json(calls)}\n"


def _parameter_rules(i: int, parameters: dict) -> tuple[list[str], list[str]]:
    """The rules of function i's parameters, in its schema's order: (uses in the
    function's rule, rule definitions)."""
    required = set(parameters.get("required") or ())
    uses, rules = [], []
    for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
        value = "TEXT" if schema.get("type") == "string" else \
            f"{_json(schema)} {quoted(CLOSE_PARAMETER)}"
        opener = quoted(f"<parameter={key}>\n")
        rules.append(f"p{i}_{j}: {opener} {value}")
        uses.append(f"p{i}_{j}" + ("" if key in required else "?"))
    return uses, rules


def qwen3_coder(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    lines = [_repeated(parallel, "\n"),
             f"call: {ref('<tool_call>')} {NEWLINE} function {ref('</tool_call>')}",
             "function: " + " | ".join(f"f{i}" for i in range(len(tools))), TEXT]
    for i, tool in enumerate(tools):
        uses, rules = _parameter_rules(i, _function(tool)["parameters"])
        head = quoted(f"<function={_function(tool)['name']}>\n")
        lines.append(f"f{i}: {head} {' '.join(uses)} {CLOSE_FUNCTION}")
        lines += rules
    return "\n".join(lines) + "\n"


BUILDERS = {"hermes": hermes, "qwen3_coder": qwen3_coder, "mistral": mistral,
            "llama3_json": llama3_json}


def tool_call_grammar(tool_parser: str, options: ChatOptions, ref: TokenRef = quoted) -> str:
    """The grammar of a reply that calls the tools `options` allow, in `tool_parser`'s
    format: the named one exactly once (as vLLM forces it: parallel_tool_calls does not
    make a named choice repeat), or any of them, several when parallel calls are
    allowed. The reply ends where the grammar does."""
    several = options.parallel_tool_calls and options.function is None
    return BUILDERS[tool_parser](options.callable_tools(), several, ref)
