"""Tools on a model of the default model's kind (`plain_model`: its vocabulary lacks
the call markers, its chat template has no tools branch), issue 23 items 3 and 4: a
forced call comes back as a call, not as text, and the tools reach the prompt though
the template does not render them. First the core, then a real server through the
`openai` and `anthropic` clients, streamed and not."""

import json
import logging

import anthropic
import openai
import pytest

from mlxd.protocol import GenerateRequest
from mlxd.tokenizer_proc.core import TokenizerCore
from mlxd.tokenizer_proc.text import TextCodec
from mlxd.tokenizer_proc.tools.syntax import resolve
from support import Server, worker_limits

LIMITS = worker_limits(kv_capacity=4000, max_context=2000, vocab_size=512)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
INJECTED = "are put in the system prompt"   # the log line's words


@pytest.fixture(scope="module")
def codec(plain_model):
    return TextCodec(plain_model)


@pytest.fixture
def core(codec):
    return TokenizerCore(codec, 64, LIMITS, syntax=resolve(codec.chat_template_text))


def test_the_model_is_of_the_default_models_kind(codec):
    tokenizer = codec.tokenizer
    assert "<tool_call>" not in tokenizer.get_vocab()
    # the trap: a marker it lacks looks up as the unknown token, which is special
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in tokenizer.all_special_ids
    assert codec.render_chat(ASK) == codec.render_chat(ASK, tools=TOOLS)
    assert resolve(codec.chat_template_text).tool_parser == "hermes"


def request(core, rid: str, **fields):
    got = []
    out = core.submit("client", GenerateRequest(rid, **fields), got.append)
    assert got == [] and len(out) == 1, got
    return out[0]


def prompt(core, rid: str, **fields) -> str:
    req = request(core, rid, **fields)
    return core.codec.tokenizer.decode(req.input_ids, skip_special_tokens=False)


def test_a_forced_call_writes_missing_markers_as_text(core):
    grammar = request(core, "r", messages=ASK, params={
        "tools": TOOLS, "tool_choice": "required"}).sampling.grammar
    assert "<tool_call>" in grammar and "<[" not in grammar


def test_tools_a_template_does_not_render_go_in_the_system_prompt(core, caplog):
    plain = prompt(core, "a", messages=ASK)
    with caplog.at_level(logging.INFO, logger="mlxd.tokenizer"):
        with_tools = prompt(core, "b", messages=ASK, params={"tools": TOOLS})
        system = [{"role": "system", "content": "Be brief."}] + ASK
        with_system = prompt(core, "c", messages=system, params={"tools": TOOLS})
    assert with_tools.endswith(plain.split("<|user|>", 1)[1])   # the chat follows
    head = with_tools.split("<|user|>", 1)[0]
    assert head.startswith("<s><|system|>") and "<tool_call>" in head
    for tool in TOOLS:
        assert json.dumps(tool) in head   # the signatures, as the hermes format shows them
    assert with_system.startswith("<s><|system|>Be brief.\n\n") and with_system.count(
        "<|system|>") == 1
    said = [r.getMessage() for r in caplog.records if INJECTED in r.getMessage()]
    assert len(said) == 1, said   # once per model, not per request
    assert prompt(core, "d", messages=ASK, params={"tools": TOOLS,
                                                   "tool_choice": "none"}) == plain


def test_a_template_that_renders_tools_gets_them_as_it_renders_them(tool_model):
    codec = TextCodec(tool_model)
    core = TokenizerCore(codec, 64, LIMITS, syntax=resolve(codec.chat_template_text))
    text = prompt(core, "r", messages=ASK, params={"tools": TOOLS})
    assert "Tools: get_weather get_time" in text and "<tools>" not in text


# ---- a real server ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(plain_model):
    server = Server(plain_model, "--kv-capacity", "8192", "--log-level", "info")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def name(plain_model):
    return plain_model.rsplit("/", 1)[-1]


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as client:
        yield client


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.http_url, api_key="none", timeout=60,
                             max_retries=0) as client:
        yield client


def valid(name: str, arguments: dict) -> bool:
    if name == "get_weather":
        return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome") \
            and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7
    return name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


def openai_reply(oai, name: str, stream: bool, **params):
    """(content, [(name, arguments)], finish_reason) of one chat completion."""
    if not stream:
        choice = oai.chat.completions.create(model=name, messages=ASK, max_tokens=200,
                                             **params).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    chunks = [c for c in oai.chat.completions.create(model=name, messages=ASK, max_tokens=200,
                                                     stream=True, **params) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    calls = [(t.function.name, json.loads(t.function.arguments))
             for d in deltas for t in d.tool_calls or []]
    return "".join(d.content or "" for d in deltas), calls, chunks[-1].choices[0].finish_reason


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_openai_forced_calls_come_back_as_calls(oai, name, stream, choice):
    content, calls, finish = openai_reply(oai, name, stream, tools=TOOLS, tool_choice=choice)
    assert (content, finish) == ("", "tool_calls")
    assert calls and all(valid(n, a) for n, a in calls)
    if choice == NAMED:
        assert [n for n, _ in calls] == ["get_time"]


def claude_reply(claude, name: str, stream: bool, max_tokens: int = 200, **params):
    """The final message of one Messages call."""
    ask = dict(model=name, messages=ASK, max_tokens=max_tokens, tools=CLAUDE_TOOLS, **params)
    if not stream:
        return claude.messages.create(**ask)
    with claude.messages.stream(**ask) as events:
        return events.get_final_message()


CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": "a tool",
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}],
                         ids=["any", "tool"])
def test_anthropic_forced_calls_come_back_as_tool_use(claude, name, stream, choice):
    msg = claude_reply(claude, name, stream, tool_choice=choice)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content if b.type != "tool_use"] == []
    uses = [(b.name, b.input) for b in msg.content]
    assert uses and all(valid(n, a) for n, a in uses)
    if choice["type"] == "tool":
        assert [n for n, _ in uses] == ["get_time"]


def test_anthropic_named_tool_is_one_call_when_sampled(claude, name):
    """Issue 23 item 2 on this API (it takes no seed, so the tokens vary but not the
    outcome; anthropic 2.x's create() has no temperature argument: sent in the body)."""
    for _ in range(4):
        msg = claude_reply(claude, name, False, extra_body={"temperature": 1.0},
                           tool_choice={"type": "tool", "name": "get_time"})
        assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_time"]


def openai_prompt_tokens(oai, name: str, stream: bool, **params) -> int:
    ask = dict(model=name, messages=ASK, max_tokens=2, **params)
    if not stream:
        return oai.chat.completions.create(**ask).usage.prompt_tokens
    chunks = list(oai.chat.completions.create(**ask, stream=True,
                                              stream_options={"include_usage": True}))
    return chunks[-1].usage.prompt_tokens


def claude_prompt_tokens(claude, name: str, stream: bool, choice: str) -> int:
    """The prompt's tokens, the prefix cache's included (Anthropic counts them apart)."""
    usage = claude_reply(claude, name, stream, 2, tool_choice={"type": choice}).usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_tools_reach_the_prompt_and_the_log_says_so_once(server, oai, claude, name):
    for stream in (False, True):
        plain = openai_prompt_tokens(oai, name, stream)
        assert openai_prompt_tokens(oai, name, stream, tools=TOOLS) > plain + 50
        plain, tools = (claude_prompt_tokens(claude, name, stream, choice)
                        for choice in ("none", "auto"))
        assert tools > plain + 50
    said = [line for line in server.stderr_lines if INJECTED in line]
    assert len(said) == 1, said
