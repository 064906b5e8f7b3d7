"""Tool calls and reasoning through the HTTP APIs, with the real `openai` and
`anthropic` clients: the core runs for real on a tiny model whose template renders
tools; the scheduler's side is played here, replying with a scripted text, so the
shapes are checked on a known reply."""

import asyncio
import json

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from mlxd.protocol import TokenBatch, TokenEntry, TokenizedRequest, Usage
from mlxd.tokenizer_proc.core import TokenizerCore
from mlxd.tokenizer_proc.http.app import build_app
from mlxd.tokenizer_proc.http.context import Api
from mlxd.tokenizer_proc.text import TextCodec
from mlxd.tokenizer_proc.tools.syntax import resolve
from support import worker_limits

LIMITS = worker_limits(kv_capacity=4000, max_context=4000, vocab_size=512)
REPLY = ('<think>The user wants the weather.</think>Checking.<tool_call>{"name": '
         '"get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": '
         '"get_time", "arguments": {"zone": "CET"}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


class ScriptedFront:
    """The tokenizer process with a scheduler that answers every request with the
    tokens of `reply`, a few at a time; it records the prompts it was sent."""

    def __init__(self, codec: TextCodec):
        self.core = TokenizerCore(codec, 64, LIMITS, syntax=resolve(codec.chat_template_text))
        self.reply = REPLY
        self.prompts: list[str] = []

    async def send(self, to_scheduler=()) -> None:
        for msg in to_scheduler:
            if isinstance(msg, TokenizedRequest):
                self.prompts.append(self.core.codec.tokenizer.decode(msg.input_ids))
                asyncio.get_running_loop().create_task(self._play(msg))

    async def _play(self, req: TokenizedRequest) -> None:
        ids = self.core.codec.tokenizer.encode(self.reply, add_special_tokens=False)
        for at in range(0, len(ids), 5):
            last = at + 5 >= len(ids)
            usage = Usage(len(req.input_ids), 0, min(at + 5, len(ids)))
            self.core.on_batch(TokenBatch([TokenEntry(
                req.rid, ids[at:at + 5], [0.0] * len(ids[at:at + 5]),
                finish_reason="stop" if last else None, usage=usage if last else None)]))
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def front(tool_model):
    return ScriptedFront(TextCodec(tool_model))


@pytest.fixture
def http(front):
    front.reply = REPLY
    with TestClient(build_app(Api(front, "m"))) as client:
        yield client


@pytest.fixture
def oai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


def test_openai_reply_carries_reasoning_and_tool_calls(oai, front):
    reply = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == \
        choice.message.model_extra["reasoning"] == "The user wants the weather."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert "Tools: get_weather get_time" in front.prompts[-1]


def test_openai_stream_has_reasoning_and_tool_call_deltas(oai):
    chunks = list(oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The user wants the weather."
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"zone": "CET"})]
    assert all(t.id.startswith("call_") and t.type == "function" for t in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_turns_go_back_through_the_template(oai, front):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
    oai.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                tool_choice="auto", parallel_tool_calls=True)
    prompt = front.prompts[-1]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>sunny</tool_response>" in prompt


def test_tool_choice_none_and_thinking_off(oai, front):
    reply = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                        tool_choice="none",
                                        extra_body={"enable_thinking": False})
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content.startswith("Checking.<tool_call>")
    assert reply.choices[0].finish_reason == "stop"
    assert "Tools:" not in front.prompts[-1] and front.prompts[-1].endswith("<think></think>")


def test_bad_tool_options_are_400_naming_them(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "nope"}})
    assert exc.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="m", messages=ASK, extra_body={
            "chat_template_kwargs": {"tools": []}})
    assert exc.value.body["param"] == "chat_template_kwargs"


def test_a_plain_reply_has_no_tool_fields(oai, front):
    front.reply = "Just text."
    message = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0]
    assert (message.message.content, message.message.tool_calls) == ("Just text.", None)
    assert message.finish_reason == "stop"


@pytest.fixture
def claude(http):
    return anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http,
                               max_retries=0)


CLAUDE_TOOLS = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]},
                {"name": "get_time", "description": "the time",
                 "input_schema": TOOLS[1]["function"]["parameters"]}]


def test_anthropic_tool_use_blocks(claude, front):
    msg = claude.messages.create(model="m", max_tokens=64, messages=ASK, tools=CLAUDE_TOOLS,
                                 tool_choice={"type": "auto"})
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use", "tool_use"]
    assert msg.content[0].text == "Checking."
    assert [(b.name, b.input) for b in msg.content[1:]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert all(b.id.startswith("toolu_") for b in msg.content[1:])
    assert "Tools: get_weather get_time" in front.prompts[-1]


def test_anthropic_stream_has_input_json_deltas(claude):
    with claude.messages.stream(model="m", max_tokens=64, messages=ASK,
                                tools=CLAUDE_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "input_json_delta" in kinds and "text_delta" in kinds
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        ("text", None), ("tool_use", {"city": "Paris"}), ("tool_use", {"zone": "CET"})]


def test_anthropic_tool_turns_go_back_through_the_template(claude, front):
    history = ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    claude.messages.create(model="m", max_tokens=64, messages=history, tools=CLAUDE_TOOLS,
                           tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    prompt = front.prompts[-1]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>sunny</tool_response>" in prompt


def test_anthropic_stop_sequence_found_after_thinking(claude, front):
    front.reply = "<think>a b</think>Answer one. END more"
    msg = claude.messages.create(model="m", max_tokens=64, messages=ASK,
                                 stop_sequences=["END"])
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == (
        "Answer one. ", "stop_sequence", "END")
