"""The compatibility policy (tokenizer_proc/http/compat.py): every row of its table
through the HTTP app, on the tiny model whose template renders tools and thinking,
with the core running for real and a scripted scheduler (test_http_tools.py): ignored
fields are accepted and change nothing, mapped ones reach the core as their mapping,
refused ones are a 400 naming them and saying what is unsupported. Also: nulls at
every depth, a reply sent back as history, two constraints, GBNF, unknown fields."""

import json

import openai
import pytest
from fastapi.testclient import TestClient

from mlxd.protocol import TokenizedRequest
from mlxd.tokenizer_proc.http import compat
from mlxd.tokenizer_proc.http.app import build_app
from mlxd.tokenizer_proc.http.compat import (
    BODY, CHAT, COMPLETIONS, IGNORED, MAPPED, MESSAGE, MESSAGES, PART, REFUSED, TABLE,
    without_nulls,
)
from mlxd.tokenizer_proc.http.context import Api
from mlxd.tokenizer_proc.text import TextCodec
from test_http_tools import TOOLS, ScriptedFront

PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions",
         MESSAGES: "/v1/messages"}
BASE = {CHAT: {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        COMPLETIONS: {"model": "m", "max_tokens": 8, "prompt": "hi"},
        MESSAGES: {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
FUNCTION = TOOLS[0]["function"]


class RecordingFront(ScriptedFront):
    """ScriptedFront that also keeps the requests the scheduler was sent."""

    def __init__(self, codec):
        super().__init__(codec)
        self.sent: list[TokenizedRequest] = []

    async def send(self, to_scheduler=()) -> None:
        self.sent += [m for m in to_scheduler if isinstance(m, TokenizedRequest)]
        await super().send(to_scheduler)


@pytest.fixture(scope="module")
def front(tool_model):
    return RecordingFront(TextCodec(tool_model))


@pytest.fixture
def http(front):
    front.reply = "Fine."
    with TestClient(build_app(Api(front, "m"))) as client:
        yield client


def post(http, api: str, **changes):
    return http.post(PATHS[api], json={**BASE[api], **changes})


def history(api: str, *messages) -> dict:
    return {"messages": [*messages, {"role": "user", "content": "and now?"}]}


def thinking_off(front) -> bool:
    return front.prompts[-1].endswith("<think></think>")


def constrained(front) -> bool:
    return front.sent[-1].sampling.grammar is not None


# One case per row of the table: (api, where, name, policy) -> the body's changes and,
# for a mapped row, what the core must have been sent.
CASES = {
    # (a) ignored: the body's changes, which must change nothing
    (CHAT, BODY, "store", IGNORED): {"store": True},
    (CHAT, BODY, "service_tier", IGNORED): {"service_tier": "auto"},
    (COMPLETIONS, BODY, "service_tier", IGNORED): {"service_tier": "default"},
    (MESSAGES, BODY, "service_tier", IGNORED): {"service_tier": "auto"},
    (CHAT, BODY, "prompt_cache_key", IGNORED): {"prompt_cache_key": "k"},
    (COMPLETIONS, BODY, "prompt_cache_key", IGNORED): {"prompt_cache_key": "k"},
    (CHAT, BODY, "safety_identifier", IGNORED): {"safety_identifier": "s"},
    (COMPLETIONS, BODY, "safety_identifier", IGNORED): {"safety_identifier": "s"},
    (CHAT, BODY, "metadata", IGNORED): {"metadata": {"a": "b"}},
    (COMPLETIONS, BODY, "metadata", IGNORED): {"metadata": {"a": "b"}},
    (MESSAGES, BODY, "metadata", IGNORED): {"metadata": {"user_id": "u"}},
    (CHAT, BODY, "user", IGNORED): {"user": "u"},
    (COMPLETIONS, BODY, "user", IGNORED): {"user": "u"},
    (CHAT, BODY, "verbosity", IGNORED): {"verbosity": "low"},
    (CHAT, BODY, "modalities", IGNORED): {"modalities": ["text"]},
    (CHAT, BODY, "cache_prompt", IGNORED): {"cache_prompt": True},
    (COMPLETIONS, BODY, "cache_prompt", IGNORED): {"cache_prompt": False},
    (MESSAGES, BODY, "context_management", IGNORED): {
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    (CHAT, MESSAGE, "annotations", IGNORED): history(
        CHAT, {"role": "assistant", "content": "Fine.", "annotations": []}),
    (CHAT, MESSAGE, "reasoning", IGNORED): history(
        CHAT, {"role": "assistant", "content": "Fine.", "reasoning": "hmm"}),
    (MESSAGES, PART, "thinking", IGNORED): history(MESSAGES, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "text", "text": "Fine."}]}),
    (MESSAGES, PART, "redacted_thinking", IGNORED): history(MESSAGES, {
        "role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                         {"type": "text", "text": "Fine."}]}),
    # (b) mapped: (the body's changes, what the core got)
    (CHAT, BODY, "reasoning_effort", MAPPED): ({"reasoning_effort": "none"}, thinking_off),
    (CHAT, BODY, "functions", MAPPED): (
        {"functions": [FUNCTION]}, lambda f: "Tools: get_weather" in f.prompts[-1]),
    (CHAT, BODY, "function_call", MAPPED): (
        {"functions": [FUNCTION], "function_call": {"name": "get_weather"}}, constrained),
    (CHAT, BODY, "n_predict", MAPPED): ({"n_predict": 3, "max_tokens": None},
                                        lambda f: f.sent[-1].max_new_tokens == 3),
    (COMPLETIONS, BODY, "n_predict", MAPPED): ({"n_predict": 3, "max_tokens": None},
                                               lambda f: f.sent[-1].max_new_tokens == 3),
    (MESSAGES, BODY, "thinking", MAPPED): ({"thinking": {"type": "disabled"}}, thinking_off),
    (MESSAGES, BODY, "output_config", MAPPED): (
        {"output_config": {"effort": "low", "format": {"type": "json_schema",
                                                       "schema": SCHEMA}}}, constrained),
    (MESSAGES, BODY, "output_format", MAPPED): (
        {"output_format": {"type": "json_schema", "schema": SCHEMA}}, constrained),
    (CHAT, MESSAGE, "refusal", MAPPED): (history(CHAT, {
        "role": "assistant", "content": None, "refusal": "I will not."}),
        lambda f: "<|assistant|>I will not.</s>" in f.prompts[-1]),
    (CHAT, MESSAGE, "function_call", MAPPED): (history(CHAT, {
        "role": "assistant", "content": None,
        "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}),
        lambda f: '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        in f.prompts[-1]),
    (CHAT, MESSAGE, "role", MAPPED): (history(CHAT, {
        "role": "assistant", "content": None,
        "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "sunny"}),
        lambda f: "<tool_response>sunny</tool_response>" in f.prompts[-1]),
    (MESSAGES, MESSAGE, "role", MAPPED): (
        {"system": "Be brief.", "messages": [{"role": "system", "content": "Be kind."},
                                             {"role": "user", "content": "hi"}]},
        lambda f: "<|system|>Be brief.\n\nBe kind.</s><|user|>hi" in f.prompts[-1]),
    (CHAT, PART, "refusal", MAPPED): (history(CHAT, {
        "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}),
        lambda f: "<|assistant|>No.</s>" in f.prompts[-1]),
    # (c) refused: (the body's changes, the parameter the 400 names)
    (CHAT, BODY, "modalities", REFUSED): ({"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, BODY, "audio", REFUSED): ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (MESSAGES, BODY, "logprobs", REFUSED): ({"logprobs": True}, "logprobs"),
    (MESSAGES, BODY, "top_logprobs", REFUSED): ({"top_logprobs": 2}, "top_logprobs"),
    (CHAT, MESSAGE, "audio", REFUSED): (history(CHAT, {
        "role": "assistant", "content": "x", "audio": {"id": "audio_1"}}), "messages.0.audio"),
    (CHAT, PART, "image_url", REFUSED): ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        "messages.0.content.1"),
    (CHAT, PART, "input_audio", REFUSED): ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
        "messages.0.content.0"),
    (CHAT, PART, "file", REFUSED): ({"messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "f"}}]}]}, "messages.0.content.0"),
    (MESSAGES, PART, "image", REFUSED): ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "messages.0.content.0"),
    (MESSAGES, PART, "document", REFUSED): ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]}, "messages.0.content.0"),
}
# The structured-output fields of other servers: each is one constraint, on both
# OpenAI endpoints.
CONSTRAINED = {"structured_outputs": {"regex": "[ab]+"}, "guided_json": SCHEMA,
               "guided_regex": "[ab]+", "guided_choice": ["yes", "no"],
               "guided_grammar": 'root ::= "yes" | "no"', "regex": "[ab]+",
               "ebnf": 'root ::= "a" "b"*', "json_schema": json.dumps(SCHEMA),
               "grammar": 'root ::= ("yes" | "no") "."'}
for _api in (CHAT, COMPLETIONS):
    for _name, _value in CONSTRAINED.items():
        CASES[_api, BODY, _name, MAPPED] = ({_name: _value}, constrained)


def _rows():
    return {(api, r.where, r.name, r.policy) for r in TABLE for api in r.apis}


def test_every_row_of_the_table_has_a_case_here():
    assert set(CASES) == _rows()


def _baseline(http, front, api: str, case: dict) -> str:
    """The prompt of the same request without the ignored field."""
    plain = {k: v for k, v in case.items() if k != "messages"}
    assert post(http, api, **{k: None for k in plain}).status_code == 200
    return front.prompts[-1]


@pytest.mark.parametrize("key", sorted(k for k in CASES if k[3] == IGNORED), ids=str)
def test_ignored_fields_are_accepted_and_change_nothing(http, front, key):
    api, where, name, _ = key
    changes = CASES[key]
    r = post(http, api, **changes)
    assert r.status_code == 200, r.text
    prompt = front.prompts[-1]
    if where == BODY:
        assert prompt == _baseline(http, front, api, changes)
    else:   # the same history without the ignored field (or part)
        assert "Fine." in prompt and "hmm" not in prompt


@pytest.mark.parametrize("key", sorted(k for k in CASES if k[3] == MAPPED), ids=str)
def test_mapped_fields_reach_the_core_as_their_mapping(http, front, key):
    api = key[0]
    changes, check = CASES[key]
    r = post(http, api, **changes)
    assert r.status_code == 200, r.text
    assert check(front), front.prompts[-1]


@pytest.mark.parametrize("key", sorted(k for k in CASES if k[3] == REFUSED), ids=str)
def test_refused_fields_are_a_400_naming_them(http, key):
    api, _, name, _ = key
    changes, param = CASES[key]
    r = post(http, api, **changes)
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"]
    assert message.startswith(param + ":") and "not supported" in message
    if api == MESSAGES:
        assert body["type"] == "error"
    else:
        assert body["error"]["param"] == param


def test_reasoning_effort_on_keeps_thinking_and_tells_the_template(http, front):
    assert post(http, CHAT, reasoning_effort="high").status_code == 200
    assert not thinking_off(front)
    r = post(http, CHAT, reasoning_effort="max")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("api, changes, param", [
    (CHAT, {"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    (CHAT, {"regex": "a+", "grammar": 'root ::= "a"'}, "grammar"),
    (COMPLETIONS, {"guided_json": SCHEMA, "json_schema": SCHEMA}, "json_schema"),
    (CHAT, {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    (CHAT, {"functions": [FUNCTION], "tools": TOOLS}, "functions"),
    (CHAT, {"n_predict": 4}, "n_predict"),   # beside the body's max_tokens
])
def test_two_fields_that_set_one_are_a_400(http, api, changes, param):
    r = post(http, api, **changes)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_gbnf_is_converted_and_a_bad_grammar_refused_by_name(http, front):
    assert post(http, CHAT, grammar='root ::= [a-z]+ "!"').status_code == 200
    assert constrained(front)
    r = post(http, CHAT, grammar="root ::= [")
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
    r = post(http, CHAT, structured_outputs={"json": SCHEMA, "whitespace_pattern": " "})
    assert r.json()["error"]["param"] == "structured_outputs.whitespace_pattern"


def test_nulls_are_dropped_at_every_depth_but_not_in_data():
    body = {"a": None, "b": {"c": None, "d": [{"e": None, "f": 1}, None]},
            "tools": [{"type": "function", "function": {
                "name": "f", "description": None,
                "parameters": {"type": "object", "default": None}}}],
            "json_schema": {"type": "null", "const": None}}
    assert without_nulls(body) == {
        "b": {"d": [{"f": 1}, None]},
        "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "default": None}}}],
        "json_schema": {"type": "null", "const": None}}


def test_a_reply_sent_back_as_history_is_accepted(http, front):
    """The assistant message as the openai package gives it (`message.model_dump()`:
    refusal, annotations, audio, function_call as null; reasoning fields)."""
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0)
    ask = [{"role": "user", "content": "hi"}]
    front.reply = "<think>hmm</think>Fine."
    reply = oai.chat.completions.create(model="m", messages=ask)
    back = reply.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(back)
    again = oai.chat.completions.create(
        model="m", messages=[*ask, back, {"role": "user", "content": "more"}],
        tools=TOOLS, parallel_tool_calls=None, store=False, metadata={"run": "1"},
        reasoning_effort="low", service_tier="auto", prompt_cache_key="k",
        safety_identifier="s", user="u", modalities=["text"])
    assert again.choices[0].message.content == "Fine."
    assert "<|assistant|>Fine.</s><|user|>more" in front.prompts[-1]


def test_an_image_in_a_tool_result_is_refused_by_name(http):
    r = post(http, MESSAGES, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": {}}]}]}])
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "messages.2.content.0.content.0: image input is not supported")


@pytest.mark.parametrize("api", [CHAT, COMPLETIONS, MESSAGES])
def test_a_field_outside_the_apis_stays_a_400_naming_it(http, api):
    r = post(http, api, frobnicate=1)
    assert r.status_code == 400 and "frobnicate" in r.text and "not support" in r.text


def test_ignored_fields_are_logged_once(http, caplog):
    with caplog.at_level("INFO", logger=compat.log.name):
        for _ in range(3):
            post(http, CHAT, verbosity="high")
    lines = [r for r in caplog.records if "verbosity" in r.getMessage()]
    assert len(lines) == 1   # once per server (an Api of its own here)
