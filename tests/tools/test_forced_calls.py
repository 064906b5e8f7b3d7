"""The grammar of a forced tool call (tools/grammar.py) and the closing of object
schemas in constrained decoding (constraints.closed_objects), checked by running
llguidance's matcher over texts: what a forced reply may be, and what it may not."""

import pytest

from mlxd.tokenizer_proc.constraints import (
    ConstraintCompiler, closed_objects, parse_response_format,
)
from mlxd.tokenizer_proc.text import TextCodec
from mlxd.tokenizer_proc.tools.grammar import tool_call_grammar
from mlxd.tokenizer_proc.tools.request import chat_options
from structured_support import grammar_acceptor

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
DATE = {"type": "function", "function": {"name": "get_date", "parameters": {
    "type": "object", "properties": {}}}}
# One call of get_time in each format, and how two calls are joined.
ONE_CALL = {
    "hermes": ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
               '</tool_call>', "\n"),
    "llama3_json": ('{"name": "get_time", "parameters": {"zone": "UTC"}}', "; "),
    "qwen3_coder": ("<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
                    "</function>\n</tool_call>", "\n"),
}
MISTRAL_CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


@pytest.fixture(scope="module")
def codec(llama_model):
    return TextCodec(llama_model)


@pytest.fixture(scope="module")
def accepts(codec):
    """accepts(grammar, text): whether the grammar allows `text` as a whole reply."""
    return grammar_acceptor(codec)


def grammar(parser: str, tools: list[dict], **params) -> str:
    return tool_call_grammar(parser, chat_options({"tools": tools, **params}))


def replies(parser: str) -> tuple[str, str]:
    """One call of get_time, and two, in `parser`'s format."""
    if parser == "mistral":
        return f"[TOOL_CALLS][{MISTRAL_CALL}]", f"[TOOL_CALLS][{MISTRAL_CALL}, {MISTRAL_CALL}]"
    call, joint = ONE_CALL[parser]
    return call, call + joint + call


NAMED = {"type": "function", "function": {"name": "get_time"}}
PARSERS = ["hermes", "llama3_json", "qwen3_coder", "mistral"]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_function_is_called_exactly_once(accepts, parser, parallel):
    """parallel_tool_calls does not make a named choice repeat (issue 23, item 2)."""
    forced = grammar(parser, [TIME, DATE], tool_choice=NAMED, parallel_tool_calls=parallel)
    one, two = replies(parser)
    assert accepts(forced, one)
    assert not accepts(forced, two)


@pytest.mark.parametrize("parser", PARSERS)
def test_required_repeats_only_when_parallel_calls_are_allowed(accepts, parser):
    one, two = replies(parser)
    for parallel in (True, False):
        forced = grammar(parser, [TIME, DATE], tool_choice="required",
                         parallel_tool_calls=parallel)
        assert accepts(forced, one) and accepts(forced, two) == parallel


def open_tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_time", "parameters": parameters}}]


def hermes_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>'


def test_a_tool_schema_without_additional_properties_allows_no_other_keys(accepts):
    """As LangChain and instructor send tools: no `additionalProperties` anywhere."""
    nested = {"type": "object", "properties": {
        "zone": {"type": "string"},
        "where": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    forced = grammar("hermes", open_tool(nested), tool_choice="required")
    assert accepts(forced, hermes_call('{"zone": "UTC", "where": {"city": "Rome"}}'))
    assert not accepts(forced, hermes_call('{"zone": "UTC", "extra": 1}'))
    assert not accepts(forced, hermes_call('{"where": {"city": "Rome", "zip": 1}}'))
    free = {**nested, "additionalProperties": True}
    forced = grammar("hermes", open_tool(free), tool_choice="required")
    assert accepts(forced, hermes_call('{"zone": "UTC", "extra": 1}'))


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_response_format_schema_is_closed_too(codec, accepts):
    compile_ = ConstraintCompiler(codec).compile
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "pet": {"$ref": "#/$defs/pet"}},
              "$defs": {"pet": {"type": "object", "properties": {"kind": {"type": "string"}}}}}
    closed = compile_(parse_response_format(json_schema(person)))
    assert accepts(closed, '{"name": "ann", "pet": {"kind": "cat"}}')
    assert not accepts(closed, '{"name": "ann", "age": 3}')
    assert not accepts(closed, '{"pet": {"kind": "cat", "age": 3}}')
    free = compile_(parse_response_format(json_schema({**person, "additionalProperties": True})))
    assert accepts(free, '{"name": "ann", "age": 3}')
    anything = compile_(parse_response_format({"type": "json_object"}))
    assert accepts(anything, '{"age": 3, "x": [1]}')


def test_closing_touches_only_object_schemas_that_list_properties():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"properties": {"t": {}}}},
        "free": {"type": "object"},
        "either": {"anyOf": [{"properties": {"b": {}}}, {"type": "string"}]},
        "both": {"allOf": [{"properties": {"c": {}}}, {"properties": {"d": {}}}]},
        "open": {"properties": {"e": {}}, "additionalProperties": {"type": "integer"}}},
        "const": {"properties": {}}}
    out = closed_objects(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False and out["const"] == {"properties": {}}
    assert set(props) == set(schema["properties"])   # a key named "properties" is a key
    assert props["properties"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["free"] == {"type": "object"}   # no properties listed: free-form
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    # parts of an intersection: closing one would refuse the other's keys
    assert props["both"] == schema["properties"]["both"]
    assert props["open"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in schema   # a copy: the request's schema is kept
