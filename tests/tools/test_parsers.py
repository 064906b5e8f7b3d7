"""The tool-call and reasoning parsers on golden replies per format, fed whole and in
random-sized pieces: text before and after calls, several calls, malformed calls."""

import json
import random
import zlib

import pytest

from mlxd.tokenizer_proc.tools.formats import PARSERS
from mlxd.tokenizer_proc.tools.output import OutputParser
from mlxd.tokenizer_proc.tools.reasoning import ThinkParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

PARIS = ("get_weather", {"city": "Paris", "days": 3})
UTC = ("get_time", {"zone": "UTC"})

# (format, reply, expected content, expected calls)
GOLDEN = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>', "", [PARIS]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {"zone": "UTC"}}\n</tool_call>\nDone.', "Let me check.\n\nDone.",
     [PARIS, UTC]),
    ("hermes", 'A <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> B',
     'A <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> B', []),
    ("hermes", 'x <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',
     "x ", [UTC]),   # cut off before its end tag, complete otherwise
    ("hermes", "Text with < and <tool and </tool_call> only.",
     "Text with < and <tool and </tool_call> only.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "",
     [PARIS]),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     "</function>\n</tool_call>", "Sure.\n", [UTC, PARIS]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\nzone=UTC\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_time>\nzone=UTC\n</function>\n</tool_call>", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "", [PARIS, UTC]),
    ("mistral", 'Checking. [TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]'
     'get_weather[ARGS]{"city": "Paris", "days": 3}', "Checking. ", [UTC, PARIS]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": ', 
     '[TOOL_CALLS][{"name": "get_time", "arguments": ', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
     "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
     '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [UTC, PARIS]),
    ("llama3_json", 'The answer is {"name": 1}.', 'The answer is {"name": 1}.', []),
    ("llama3_json", '  {"json": "but not a call"}', '  {"json": "but not a call"}', []),
]


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def run(parser, parts: list[str]) -> tuple[str, list]:
    content, calls = [], []
    for part in parts:
        text, found = parser.feed(part)
        content.append(text)
        calls += found
    text, found = parser.finish()
    return "".join(content) + text, calls + found


def as_pairs(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt, reply, content, calls", GOLDEN)
def test_whole_and_streamed_in_random_pieces(fmt, reply, content, calls):
    got_content, got_calls = run(PARSERS[fmt](TOOLS), [reply])
    assert (got_content, as_pairs(got_calls)) == (content, calls)
    rng = random.Random(zlib.crc32(reply.encode()))
    for _ in range(20):
        got_content, got_calls = run(PARSERS[fmt](TOOLS), pieces(reply, rng))
        assert (got_content, as_pairs(got_calls)) == (content, calls)


def test_markup_never_reaches_content_mid_stream():
    """A marker split over pieces is held back until it is known."""
    parser = PARSERS["hermes"](TOOLS)
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.feed("_ca") == ("", [])
    text, calls = parser.feed('ll>{"name": "get_time", "arguments": {}}</tool_call>')
    assert text == "" and as_pairs(calls) == [("get_time", {})]


def test_call_ids_are_distinct_and_openai_shaped():
    _, calls = run(PARSERS["hermes"](TOOLS), [GOLDEN[1][1]])
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[1].as_wire(1) == {"index": 1, "id": calls[1].id, "name": "get_time",
                                   "arguments": '{"zone": "UTC"}'}


def test_qwen3_coder_values_take_their_declared_types():
    reply = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
             "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    _, calls = run(PARSERS["qwen3_coder"](TOOLS), [reply])
    assert as_pairs(calls) == [("get_weather", {"city": "42", "days": 2})]


THINK = [
    ("<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", False, "\nLet me see: 2+2.\n", "It is 4."),
    ("Let me see.</think>4", True, "Let me see.", "4"),     # the prompt opened it
    ("No thinking here <think> at all", False, "", "No thinking here <think> at all"),
    ("<think>still thinking when cut off", False, "still thinking when cut off", ""),
    ("  <think></think>Answer", False, "", "Answer"),
]


@pytest.mark.parametrize("reply, opened, reasoning, content", THINK)
def test_thinking_split_whole_and_streamed(reply, opened, reasoning, content):
    rng = random.Random(len(reply))
    for parts in [[reply]] + [pieces(reply, rng) for _ in range(20)]:
        parser, got = ThinkParser(opened), [[], []]
        for part in parts + [None]:
            r, c = parser.feed(part) if part is not None else parser.finish()
            got[0].append(r)
            got[1].append(c)
        assert ("".join(got[0]), "".join(got[1])) == (reasoning, content)


def test_tool_calls_are_parsed_in_the_answer_only():
    reply = ('<think>maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
             '</think>Calling.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
             '</tool_call>')
    parser = OutputParser(PARSERS["hermes"](TOOLS), ThinkParser())
    first, last = parser.feed(reply), parser.finish()
    assert first.reasoning + last.reasoning == \
        'maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert first.content + last.content == "Calling."
    assert as_pairs(first.tool_calls + last.tool_calls) == [UTC] and parser.calls == 1
