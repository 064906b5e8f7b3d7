"""Anthropic's request shape as Claude Code sends it, on a real server (the tiny model
whose template renders tools and thinking; its text is random, so shapes, counts and
agreement between paths are checked), through the real `anthropic` and `openai`
packages: count_tokens, forced tools, prefill on both APIs, thinking, the input count
in message_start, the prompt-too-long wording, /v1/models in Anthropic's shape, and a
hand-written copy of Claude Code's first request, streamed."""

import json

import anthropic
import httpx
import openai
import pytest

from mlxd.tokenizer_proc.text import TextCodec
from support import Server

TOOLS = [{"name": "get_weather", "description": "the weather in a city",
          "input_schema": {"type": "object", "properties": {
              "city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tool_model):
    server = Server(tool_model, "--kv-capacity", "8192", "--log-level", "warning",
                    "--tool-call-parser", "hermes", "--reasoning-parser", "think")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.http_url, api_key="none", timeout=60,
                             max_retries=0) as client:
        yield client


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as client:
        yield client


def model(tool_model) -> str:
    from pathlib import Path

    return Path(tool_model).name


def test_count_tokens_counts_the_prompt_a_request_gets(claude, tool_model):
    """System, tools and messages rendered as for a real request: its usage says so."""
    name = model(tool_model)
    shape = {"model": name, "system": "You check the weather.", "messages": ASK,
             "tools": TOOLS}
    counted = claude.messages.count_tokens(**shape).input_tokens
    reply = claude.messages.create(max_tokens=4, **shape)
    assert counted == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    bare = claude.messages.count_tokens(model=name, messages=ASK).input_tokens
    assert bare < counted   # the system prompt and the tools are counted


def test_thinking_disabled_closes_the_think_block(claude, tool_model):
    name = model(tool_model)
    codec = TextCodec(tool_model)
    closed = len(codec.encode_text("<think></think>"))
    on = claude.messages.count_tokens(model=name, messages=ASK,
                                      thinking={"type": "adaptive"}).input_tokens
    off = claude.messages.count_tokens(model=name, messages=ASK,
                                       thinking={"type": "disabled"}).input_tokens
    assert off == on + closed
    reply = claude.messages.create(model=name, max_tokens=4, messages=ASK,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert reply.type == "message"


def test_a_forced_tool_is_called_with_valid_input(claude, tool_model):
    """(Thinking off: the random model would think until max_tokens first.)"""
    reply = claude.messages.create(model=model(tool_model), max_tokens=64, messages=ASK,
                                   tools=TOOLS, thinking={"type": "disabled"},
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].input["city"] in ("Paris", "Rome")


def test_an_assistant_prefill_is_continued_on_both_apis(claude, oai, server, tool_model):
    """The reply continues the final assistant message, as a raw completion of the
    chat rendered open does (greedy, so the same text)."""
    name = model(tool_model)
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    codec = TextCodec(tool_model)
    open_chat = codec.render_chat(prefill, continue_final=True)
    assert open_chat.endswith("The weather in Paris is")
    expected = oai.completions.create(model=name, prompt=codec.encode_rendered(open_chat),
                                      max_tokens=8, temperature=0).choices[0].text
    reply = claude.messages.create(model=name, max_tokens=8, messages=prefill)
    assert "".join(b.text for b in reply.content if b.type == "text") == expected
    chat = oai.chat.completions.create(model=name, max_tokens=8, messages=prefill)
    assert chat.choices[0].message.content == expected
    new_turn = oai.chat.completions.create(model=name, max_tokens=8, messages=prefill,
                                           extra_body={"add_generation_prompt": True})
    assert new_turn.usage.prompt_tokens == chat.usage.prompt_tokens + len(
        codec.encode_text("</s><|assistant|>"))


def test_message_start_carries_the_input_count(claude, tool_model):
    name = model(tool_model)
    ask = [{"role": "user", "content": "A question nobody asked before: why?"}]
    counted = claude.messages.count_tokens(model=name, messages=ask).input_tokens
    with claude.messages.stream(model=name, max_tokens=4, messages=ask) as stream:
        start = next(e for e in stream if e.type == "message_start")
        list(stream)
    usage = start.message.usage
    assert usage.input_tokens > 0
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted


def test_a_prompt_too_long_is_said_in_anthropics_words(claude, tool_model):
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=model(tool_model), max_tokens=4, messages=[
            {"role": "user", "content": "a " * 3000}])
    message = exc.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" maximum")
    n, limit = message.removeprefix("prompt is too long: ").removesuffix(" maximum").split(
        " tokens > ")
    assert int(n) > int(limit) > 0


def test_models_answer_an_anthropic_client_in_its_shape(claude, oai, tool_model):
    cards = claude.models.list().data
    assert [c.id for c in cards] == [model(tool_model)]
    card = cards[0]
    assert card.type == "model" and card.display_name == model(tool_model)
    assert card.created_at.year >= 2024 and card.to_dict()["max_input_tokens"] > 0
    assert claude.models.retrieve(model(tool_model)).id == model(tool_model)
    assert oai.models.list().data[0].object == "model"   # OpenAI's shape without the header


# Claude Code's first request, as it sends it (hand-written from its shape: system as
# blocks with cache_control, system reminders in the first user message, tools with a
# $schema, metadata, thinking, context_management, output_config, streamed).
def claude_code_request(name: str) -> dict:
    return {
        "model": name, "max_tokens": 32, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "You are an interactive CLI tool.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": "Working directory: /tmp/project"},
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>As you answer, use the "
                 "context below.</system-reminder>"},
                {"type": "text", "text": "list the files here",
                 "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "Bash", "description": "Executes a bash command",
                   "input_schema": {
                       "$schema": "http://json-schema.org/draft-07/schema#",
                       "type": "object", "additionalProperties": False,
                       "properties": {"command": {"type": "string"},
                                      "timeout": {"type": "number"}},
                       "required": ["command"]},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                          "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def test_claude_codes_first_request_streams(server, tool_model):
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "none",
               "anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        with http.stream("POST", "/v1/messages", headers=headers,
                         json=claude_code_request(model(tool_model))) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines
              if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    # the real count, split as Anthropic splits it (its breakpoints pin the prompt)
    usage = events[0]["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_creation_input_tokens"] > 0
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(starts))) and starts
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("n, max_tokens, context, kv, expected", [
    (3000, 4, 2048, 8192, "prompt is too long: 3000 tokens > 2048 maximum"),
    (3000, 4, 4096, 2048, "prompt is too long: 3000 tokens > 2048 maximum"),
    (1000, 2000, 4096, 2048, "input length and `max_tokens` exceed context limit: 1000 + "
     "2000 > 2049, decrease input length or `max_tokens` and try again"),
])
def test_every_length_error_of_the_core_reads_as_anthropics(n, max_tokens, context, kv,
                                                            expected):
    """The wording follows runtime/request_limits.py's, whatever limit was hit."""
    from mlxd.protocol import ErrorReply
    from mlxd.runtime.request_limits import length_error
    from mlxd.tokenizer_proc.http.anthropic_api import anthropic_error

    message = length_error(n, max_tokens, context, kv)
    err = anthropic_error(ErrorReply("0", "invalid_request", message, "prompt"))
    assert (err.status, err.message, err.param) == (400, expected, "messages")
