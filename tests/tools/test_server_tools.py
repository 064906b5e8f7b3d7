"""Tools and reasoning on a real server (the tiny model whose template renders tools;
its text is random, so only shapes and agreement between the paths are checked), and
calls forced valid by the grammar once constrained decoding exists."""

import itertools
import json

import openai
import pytest

from mlxd import Client
from mlxd.tokenizer_proc.text import TextCodec
from support import Server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tool_model):
    server = Server(tool_model, "--kv-capacity", "8192", "--log-level", "warning",
                    "--tool-call-parser", "hermes", "--reasoning-parser", "think")
    yield server
    server.stop()


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as client:
        yield client


def test_tools_reach_the_template_and_every_path_agrees(server, oai, tool_model):
    name = tool_model.rsplit("/", 1)[-1]
    ask = dict(model=name, messages=ASK, max_tokens=16)
    plain = oai.chat.completions.create(**ask)
    whole = oai.chat.completions.create(**ask, tools=TOOLS)
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens   # the tools' names
    assert whole.choices[0].finish_reason in ("length", "stop", "tool_calls")
    streamed = list(oai.chat.completions.create(**ask, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in streamed]
    assert "".join(d.content or "" for d in deltas) == (whole.choices[0].message.content or "")
    with Client(server.address, timeout=60) as client:
        result = client.chat(ASK, tools=TOOLS, max_tokens=16)
    assert result.text == (whole.choices[0].message.content or "")
    assert [c.name for c in result.tool_calls] == \
        [c.function.name for c in whole.choices[0].message.tool_calls or []]
    assert result.finish_reason == whole.choices[0].finish_reason


def valid_call(name: str, arguments: dict) -> bool:
    if name == "get_weather":
        return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome") \
            and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7
    return name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


# The test model's template thinks, and a random model allowed to think first (the
# constraint starts after its thinking) may think until max_tokens.
NO_THINKING = {"enable_thinking": False}


def test_required_and_named_calls_are_valid_on_a_random_model(oai, tool_model):
    name = tool_model.rsplit("/", 1)[-1]
    for seed in range(8):
        reply = oai.chat.completions.create(
            model=name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
            temperature=1.0, seed=seed, parallel_tool_calls=False, extra_body=NO_THINKING)
        [call] = reply.choices[0].message.tool_calls
        assert valid_call(call.function.name, json.loads(call.function.arguments))
        assert reply.choices[0].finish_reason == "tool_calls"
    named = oai.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body=NO_THINKING)
    calls = named.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" and
                         valid_call("get_time", json.loads(c.function.arguments))
                         for c in calls)




def test_a_named_choice_makes_exactly_one_call(server, oai, tool_model):
    """A named function is one call, parallel_tool_calls or not (issue 23, item 2),
    over OpenAI (parallel on and off) and the SDK at temperature 1 over several seeds,
    EOS biased down as well as not: this tiny model ends after a call of its own
    accord, a model that would rather go on must still be stopped by the grammar.
    Covered elsewhere: `required` with parallel_tool_calls false (the test above),
    `required` with it on (may repeat: test_forced_calls.py checks the grammar),
    Anthropic's {"type": "tool"} (test_plain_vocab_tools.py, on a model that does not
    think: that API cannot turn thinking off). `auto` is not held to
    parallel_tool_calls: only a forced call's grammar enforces it."""
    name = tool_model.rsplit("/", 1)[-1]
    named = {"type": "function", "function": {"name": "get_time"}}
    ask = dict(messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200,
               temperature=1.0)
    eos = TextCodec(tool_model).tokenizer.eos_token_id
    with Client(server.address, timeout=60) as client:
        for seed, bias in itertools.product(range(4), ({}, {eos: -100})):
            for parallel in (True, False):
                reply = oai.chat.completions.create(
                    model=name, **ask, seed=seed, parallel_tool_calls=parallel,
                    logit_bias={str(k): v for k, v in bias.items()}, extra_body=NO_THINKING)
                [call] = reply.choices[0].message.tool_calls
                assert call.function.name == "get_time"
                assert reply.choices[0].finish_reason == "tool_calls"
            result = client.chat(**ask, seed=seed, logit_bias=bias, enable_thinking=False)
            assert [c.name for c in result.tool_calls] == ["get_time"], result
