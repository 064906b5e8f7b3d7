"""The tokenizer core with tools and reasoning: tools and tool turns through the chat
template, replies split into reasoning, content and tool calls, streamed and not."""

import json

import pytest

from mlxd.protocol import ErrorReply, GenerateRequest, TokenBatch, TokenEntry, TokenizedRequest
from mlxd.tokenizer_proc.core import TokenizerCore
from mlxd.tokenizer_proc.text import TextCodec
from mlxd.tokenizer_proc.tools.syntax import OutputSyntax, resolve
from support import worker_limits

LIMITS = worker_limits(kv_capacity=1000, max_context=1000, vocab_size=512)
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
REPLY = ('<think>They want the time.</think>\n\nLet me look.<tool_call>{"name": "get_time", '
         '"arguments": {"zone": "UTC"}}</tool_call>')


@pytest.fixture(scope="module")
def codec(tool_model):
    return TextCodec(tool_model)


@pytest.fixture
def core(codec):
    return TokenizerCore(codec, 16, LIMITS, syntax=resolve(codec.chat_template_text))


def submit(core, got: list, **fields):
    out = core.submit("client", GenerateRequest("r", **fields), got.append)
    assert got == [] and len(out) == 1 and isinstance(out[0], TokenizedRequest), got
    return out[0]


def finish(core, codec, rid: int, text: str, pieces: int = 1) -> None:
    ids = codec.tokenizer.encode(text, add_special_tokens=False)
    step = -(-len(ids) // pieces)
    for at in range(0, len(ids), step):
        last = at + step >= len(ids)
        core.on_batch(TokenBatch([TokenEntry(rid, ids[at:at + step], [0.0] * len(
            ids[at:at + step]), finish_reason="stop" if last else None)]))


def test_the_template_picks_hermes_and_thinking(codec):
    assert resolve(codec.chat_template_text) == OutputSyntax("hermes", True)


def test_tools_and_tool_turns_go_through_the_template(core, codec):
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    req = submit(core, [], messages=messages, params={"tools": [TIME]})
    text = codec.tokenizer.decode(req.input_ids, skip_special_tokens=False)
    assert "Tools: get_time" in text
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in text
    assert "<tool_response>12:00</tool_response>" in text


def test_enable_thinking_reaches_the_template(core, codec):
    user = [{"role": "user", "content": "Hi"}]
    off = submit(core, [], messages=user, params={"enable_thinking": False})
    core.abort("client", "r")
    assert codec.tokenizer.decode(off.input_ids).endswith("<think></think>")


@pytest.mark.parametrize("stream, pieces", [(False, 1), (True, 1), (True, 7), (True, 40)])
def test_a_reply_splits_into_reasoning_content_and_calls(core, codec, stream, pieces):
    got = []
    req = submit(core, got, messages=[{"role": "user", "content": "Time?"}],
                 params={"tools": [TIME]}, stream=stream)
    finish(core, codec, req.rid, REPLY, pieces)
    assert "".join(c.reasoning or "" for c in got) == "They want the time."
    assert "".join(c.text for c in got) == "Let me look."
    [call] = [call for c in got for call in c.tool_calls or []]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["name"] == "get_time"
    assert json.loads(call["arguments"]) == {"zone": "UTC"}
    assert got[-1].finish_reason == "tool_calls"
    assert all("<" not in c.text for c in got)


def test_without_tools_markup_stays_content_but_thinking_is_split(core, codec):
    got = []
    req = submit(core, got, messages=[{"role": "user", "content": "Time?"}])
    finish(core, codec, req.rid, REPLY)
    [chunk] = got
    assert chunk.reasoning == "They want the time." and chunk.tool_calls is None
    assert chunk.text.startswith("Let me look.<tool_call>") and chunk.finish_reason == "stop"


def test_tool_choice_none_renders_no_tools_and_parses_none(core, codec):
    got = []
    req = submit(core, got, messages=[{"role": "user", "content": "Time?"}],
                 params={"tools": [TIME], "tool_choice": "none"})
    assert "Tools:" not in codec.tokenizer.decode(req.input_ids)
    finish(core, codec, req.rid, REPLY)
    assert got[0].tool_calls is None and "<tool_call>" in got[0].text


def test_a_prompt_that_opens_thinking_starts_the_reply_in_it(core, codec):
    got = []
    req = submit(core, got, messages=[{"role": "user", "content": "Q?"}],
                 params={"chat_template_kwargs": {"open_thinking": True}})
    finish(core, codec, req.rid, "pondering</think>Answer.")
    assert (got[0].reasoning, got[0].text) == ("pondering", "Answer.")


def test_a_raw_prompt_is_not_split(core, codec):
    got = []
    req = submit(core, got, prompt="Question?<think>")
    finish(core, codec, req.rid, "pondering</think>Answer.")
    assert (got[0].reasoning, got[0].text) == (None, "pondering</think>Answer.")


def test_bad_tool_options_are_invalid_requests(core):
    got = []
    assert core.submit("client", GenerateRequest("r", prompt="x", params={
        "tool_choice": "required"}), got.append) == []
    [reply] = got
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request"
    assert "needs tools" in reply.message


def test_required_calls_carry_the_grammar_of_a_call(core):
    got = []
    req = submit(core, got, prompt="x", params={"tools": [TIME], "tool_choice": "required"})
    assert "get_time" in repr(req)   # the grammar travels with the request
    core.submit("client", GenerateRequest("s", prompt="x", params={
        "tools": [TIME], "tool_choice": "required",
        "response_format": {"type": "json_object"}}), got.append)
    assert got[-1].code == "invalid_request" and "response_format" in got[-1].message


def test_a_reasoning_models_constraint_starts_after_its_thinking(core):
    def grammar(rid, **fields):
        got = []
        [req] = core.submit("client", GenerateRequest(rid, **fields), got.append)
        assert got == []
        return req.sampling.grammar

    ask = [{"role": "user", "content": "Time?"}]
    as_json = {"response_format": {"type": "json_object"}}
    assert "think_text" in grammar("a", messages=ask, params=as_json)   # may think first
    assert "think_text" not in grammar("b", prompt="Time?", params=as_json)   # raw text
    forced = {"tools": [TIME], "tool_choice": "required"}
    assert "think_text" in grammar("c", messages=ask, params=forced)
    assert "think_text" not in grammar("d", messages=ask, params={**forced,   # turned off
                                                                  "enable_thinking": False})
