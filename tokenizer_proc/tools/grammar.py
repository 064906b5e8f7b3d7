"""The grammar that makes a reply a tool call, in the model's own format: Lark in
llguidance's flavour, with `%json` for the calls (a tool's name as a constant, its
parameters' schema for the arguments). Sent as the request's
`response_format: {"type": "grammar", "grammar": ...}`."""

import json
from typing import Callable

from ..constraints import JSON_OPTIONS, closed_objects
from ..params import InvalidRequest
from .mlx_lm_formats import markers
from .request import ChatOptions
from .syntax import markers_of


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


def _literal(tool_parser: str, ref: TokenRef) -> Callable[[str], str]:
    """Text of the format as the grammar writes it: its markers by `ref` (a special
    token by id), the rest quoted."""
    specials = sorted(markers_of(tool_parser), key=len, reverse=True)

    def literal(text: str) -> str:
        pieces, at = [], 0
        while at < len(text):
            marker = next((m for m in specials if text.startswith(m, at)), None)
            if marker is not None:
                pieces.append(ref(marker))
                at += len(marker)
                continue
            ends = [i for m in specials if (i := text.find(m, at)) >= 0]
            end = min(ends, default=len(text))
            pieces.append(quoted(text[at:end]))
            at = end
        return " ".join(pieces)
    return literal


def _json_in_markers(tool_parser: str) -> "Builder":
    """Formats whose parser also reads a block of `{"name": ..., "arguments": ...}`
    JSON (GLM's and LongCat's fall back to it): forced calls are written that way."""
    def build(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
        start, end = markers(tool_parser)
        lit = _literal(tool_parser, ref)
        call = f"call: {lit(start)} {_json(_call_schema(tools, 'arguments'))} {lit(end or '')}"
        return "\n".join([_repeated(parallel, "\n"), call]) + "\n"
    return build


def _calls_within(head: str, calls: list[str], tail: str, parallel: bool) -> list[str]:
    """Rules of a section (`head` ... `tail`) holding one call, or several."""
    return [f"start: {head} call{'+' if parallel else ''} {tail}",
            "call: " + " | ".join(calls)]


def kimi_k2(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    """`<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:N`
    `<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`."""
    lit = _literal("kimi_k2", ref)
    calls = [f"{lit('<|tool_call_begin|>functions.' + _function(t)['name'] + ':')} /[0-9]/ "
             f"{lit('<|tool_call_argument_begin|>')} {_json(_function(t)['parameters'])} "
             f"{lit('<|tool_call_end|>')}" for t in tools]
    lines = _calls_within(lit("<|tool_calls_section_begin|>"), calls,
                          lit("<|tool_calls_section_end|>"), parallel)
    return "\n".join(lines) + "\n"


def kimi_k3(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    """A tools section of calls, each with its arguments as one JSON block."""
    lit = _literal("kimi_k3", ref)
    opener = '<|open|>call tool="{}"<|sep|><|open|>json type="object"<|sep|>'
    closer = lit("<|close|>json<|sep|><|close|>call<|sep|>")
    calls = [f"{lit(opener.format(_function(t)['name']))} "
             f"{_json(_function(t)['parameters'])} {closer}" for t in tools]
    lines = _calls_within(lit("<|open|>tools<|sep|>"), calls, lit("<|close|>tools<|sep|>"),
                          parallel)
    return "\n".join(lines) + "\n"


def _keyword_calls(tools: list[dict], head: Callable[[str], str],
                   parameter: Callable[[str], tuple[str, str]], tail: str) -> list[str]:
    """Calls (one per tool, then its rules) of formats that write each parameter as
    `opener` + its JSON value + `closer`, in the schema's order, optional ones
    optional."""
    calls, rules = [], []
    for i, tool in enumerate(tools):
        parameters = _function(tool)["parameters"]
        required = set(parameters.get("required") or ())
        uses = []
        for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            opener, closer = parameter(key)
            rules.append(f"p{i}_{j}: {quoted(opener)} {_json(schema)} {quoted(closer)}")
            uses.append(f"p{i}_{j}" + ("" if key in required else "?"))
        calls.append(f"f{i}")
        rules.append(f"f{i}: {quoted(head(_function(tool)['name']))} {' '.join(uses)} "
                     f"{quoted(tail)}")
    return ["call: " + " | ".join(calls), *rules]


def pythonic(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    """`<|tool_call_start|>[name(key=value, ...)]<|tool_call_end|>`, values as JSON (a
    Python literal too, true/false/null read as Python's), each followed by `, `."""
    lit = _literal("pythonic", ref)
    many = 'call (", " call)*' if parallel else "call"
    rules = _keyword_calls(tools, lambda name: f"{name}(", lambda key: (f"{key}=", ", "), ")")
    start = f'start: {lit("<|tool_call_start|>")} "[" {many} "]" {lit("<|tool_call_end|>")}'
    return "\n".join([start, *rules]) + "\n"


def muse_spark(tools: list[dict], parallel: bool, ref: TokenRef) -> str:
    """`<atem:function_calls><atem:invoke name="NAME"><atem:parameter name="KEY">`
    JSON value `</atem:parameter>...</atem:invoke></atem:function_calls>`."""
    lit = _literal("muse_spark", ref)
    start, end = markers("muse_spark")
    many = "call+" if parallel else "call"
    rules = _keyword_calls(tools, lambda name: f'<atem:invoke name="{name}">',
                           lambda key: (f'<atem:parameter name="{key}">', "</atem:parameter>"),
                           "</atem:invoke>")
    return "\n".join([f"start: {lit(start)} {many} {lit(end or '')}", *rules]) + "\n"


Builder = Callable[[list[dict], bool, TokenRef], str]
BUILDERS: dict[str, Builder] = {
    "hermes": hermes, "json_tools": hermes, "qwen3_coder": qwen3_coder,
    "mistral": mistral, "llama3_json": llama3_json, "kimi_k2": kimi_k2,
    "kimi_k3": kimi_k3, "pythonic": pythonic, "muse_spark": muse_spark,
    **{name: _json_in_markers(name) for name in ("glm47", "laguna", "longcat")}}
# Formats without a forced-call grammar: their values are written in ways JSON does
# not give (Gemma's `<|"|>` and `<escape>` strings, nested objects the parsers' brace
# matching cuts short; MiniMax's and MiniCPM's raw strings, stripped, without `<`).
UNFORCED = ("function_gemma", "gemma4", "minimax_m2", "minicpm5")


def tool_call_grammar(tool_parser: str, options: ChatOptions, ref: TokenRef = quoted) -> str:
    """The grammar of a reply that calls the tools `options` allow, in `tool_parser`'s
    format: the named one exactly once (as vLLM forces it: parallel_tool_calls does not
    make a named choice repeat), or any of them, several when parallel calls are
    allowed. The reply ends where the grammar does. InvalidRequest for a format
    without one (UNFORCED)."""
    if tool_parser not in BUILDERS:
        raise InvalidRequest(f"this model's tool-call format ({tool_parser}) cannot be "
                             "forced: tool_choice 'required' or a named function is not "
                             "served for it; use 'auto'", "tool_choice")
    several = options.parallel_tool_calls and options.function is None
    return BUILDERS[tool_parser](options.callable_tools(), several, ref)
