"""The Responses API (`/v1/responses`) with the real `openai` client: the core runs
for real on the tiny model whose template renders tools and thinks in <think>; the
scheduler's side is played by test_http_tools.py's ScriptedFront, which answers with a
known text, so the shapes, the event sequence and the store are checked exactly. The
final objects are validated with the SDK's own pydantic types."""

import json

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from mlxd.protocol import TokenBatch, TokenEntry, Usage
from mlxd.tokenizer_proc.http.app import build_app
from mlxd.tokenizer_proc.http.context import Api
from mlxd.tokenizer_proc.http.responses_store import ResponseStore
from mlxd.tokenizer_proc.text import TextCodec
from test_http_tools import REPLY, ScriptedFront

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "get_time", "description": "the time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}]
EVENTS = TypeAdapter(ResponseStreamEvent)


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


def check(response) -> Response:
    """The response as the SDK's strict pydantic model (raises if it does not fit)."""
    return Response.model_validate(response.model_dump(mode="json", exclude_unset=True))


def test_text_input_gives_reasoning_message_and_calls(oai, front):
    r = check(oai.responses.create(model="m", input="Weather and time in Paris?",
                                   instructions="Be brief.", tools=TOOLS))
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call",
                                                "function_call"]
    reasoning, message, *calls = r.output
    assert reasoning.content[0].text == "The user wants the weather."
    assert r.output_text == message.content[0].text == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    assert r.usage.input_tokens > 0   # the scripted scheduler's usage: shape only
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert front.prompts[-1].startswith("<s><|system|>Tools: get_weather get_time</s>"
                                        "<|system|>Be brief.</s><|user|>Weather")
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]


def stream_events(oai, **ask) -> list:
    with oai.responses.create(stream=True, **ask) as stream:
        return [EVENTS.validate_python(e.model_dump(mode="json")) for e in stream]


def test_the_stream_has_the_responses_event_sequence(oai):
    events = stream_events(oai, model="m", input="Weather?", tools=TOOLS)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = ["response.content_part.added", "DELTA", "DONE",
                "response.content_part.done"]
    call = ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    items = split_items(kinds[2:-1])
    assert [body for _, body in items] == [
        [s.replace("DELTA", "response.reasoning_text.delta").replace(
            "DONE", "response.reasoning_text.done") for s in streamed],
        [s.replace("DELTA", "response.output_text.delta").replace(
            "DONE", "response.output_text.done") for s in streamed], call, call]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call",
                                              "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == "Checking."
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {"zone": "CET"}]
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def split_items(kinds: list[str]) -> list[tuple[str, list[str]]]:
    """Per output item: its events between added and done, a run of deltas as one."""
    items, body = [], []
    for kind in kinds:
        if kind == "response.output_item.added":
            body = []
        elif kind == "response.output_item.done":
            items.append((kind, body))
        elif not (kind.endswith(".delta") and body and body[-1] == kind):
            body.append(kind)
    return items


def test_the_sdk_stream_helper_assembles_the_same_response(oai):
    whole = oai.responses.create(model="m", input="Weather?", tools=TOOLS)
    with oai.responses.stream(model="m", input="Weather?", tools=TOOLS) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert [i.type for i in final.output] == [i.type for i in whole.output]


def test_a_function_call_round_trip_with_full_history_and_with_previous_id(oai, front):
    first = oai.responses.create(model="m", input="Weather?", tools=TOOLS)
    call = next(i for i in first.output if i.type == "function_call")
    front.reply = "It is sunny."
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    history = [{"role": "user", "content": "Weather?"},
               *[i.model_dump(exclude_unset=True) for i in first.output], result]
    by_history = oai.responses.create(model="m", input=history, tools=TOOLS)
    prompt_by_history = front.prompts[-1]
    chained = oai.responses.create(model="m", input=[result], tools=TOOLS,
                                   previous_response_id=first.id)
    assert chained.previous_response_id == first.id
    assert by_history.output_text == chained.output_text == "It is sunny."
    assert front.prompts[-1] == prompt_by_history
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in \
        prompt_by_history and "<tool_response>sunny</tool_response>" in prompt_by_history
    assert "The user wants" not in prompt_by_history   # reasoning is not sent back


def test_stored_responses_can_be_read_listed_and_deleted(oai, http):
    r = oai.responses.create(model="m", input="Weather?", tools=TOOLS)
    got = check(oai.responses.retrieve(r.id))
    assert got.id == r.id and got.output_text == r.output_text and got.status == "completed"
    items = oai.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].role == "user"
    again = http.get(f"/v1/responses/{r.id}", params={"stream": "true"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    deleted = oai.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.retrieve(r.id)
    assert exc.value.body["type"] == "not_found_error" and r.id in exc.value.body["message"]


def test_a_missing_id_is_a_404_in_openai_shape(http):
    for method, path in (("GET", "/v1/responses/resp_nope"),
                         ("DELETE", "/v1/responses/resp_nope"),
                         ("POST", "/v1/responses/resp_nope/cancel")):
        r = http.request(method, path)
        assert r.status_code == 404, (method, path)
        error = r.json()["error"]
        assert error["type"] == "not_found_error" and "resp_nope" in error["message"]
    r = http.post("/v1/responses", json={"model": "m", "input": "hi",
                                         "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_store_false_keeps_nothing_and_keys_see_only_their_own(front, oai):
    r = oai.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    kept = oai.responses.create(model="m", input="hi")
    with TestClient(build_app(Api(front, "m"))) as other_app:
        assert other_app.get(f"/v1/responses/{kept.id}").status_code == 404   # another app
    other = openai.OpenAI(base_url="http://testserver/v1", api_key="someone-else",
                          http_client=oai._client, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)


def test_the_store_is_bounded_least_recent_first():
    store = ResponseStore(max_responses=2)
    entries = [store.start("me", {"id": f"resp_{i}", "status": "in_progress"}, None)
               for i in range(3)]
    for entry in entries:
        store.finish(entry, entry.response, [], [])
    assert len(store) == 2
    with pytest.raises(Exception):
        store.get("me", "resp_0")
    assert store.get("me", "resp_2").response["id"] == "resp_2"


def test_max_output_tokens_temperature_and_text_format_reach_the_core(http, front):
    front.reply = '{"city": "Paris"}'
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    r = http.post("/v1/responses", json={
        "model": "m", "input": "City?", "max_output_tokens": 30, "temperature": 0.5,
        "top_p": 0.9, "text": {"format": {"type": "json_schema", "name": "city",
                                          "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"]["format"]["type"] == "json_schema"
    assert (body["temperature"], body["top_p"], body["max_output_tokens"]) == (0.5, 0.9, 30)
    bad = http.post("/v1/responses", json={"model": "m", "input": "City?", "text": {
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "integer",
                                                                 "minimum": "ten"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format"
    bad = http.post("/v1/responses", json={"model": "m", "input": "hi",
                                           "max_output_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_output_tokens"


def test_reasoning_effort_none_turns_thinking_off(oai, front):
    front.reply = "Plain."
    oai.responses.create(model="m", input="hi", reasoning={"effort": "none"})
    assert front.prompts[-1].endswith("<|assistant|><think></think>")
    oai.responses.create(model="m", input="hi", reasoning={"effort": "low"})
    assert not front.prompts[-1].endswith("<think></think>")


def test_tool_choice_forms_reach_the_core(http, front):
    front.reply = "Plain."
    for choice in ("none", "auto", "required", {"type": "function", "name": "get_time"},
                   {"type": "allowed_tools", "mode": "auto",
                    "tools": [{"type": "function", "name": "get_time"}]}):
        r = http.post("/v1/responses", json={"model": "m", "input": "hi", "tools": TOOLS,
                                             "tool_choice": choice})
        assert r.status_code == 200, (choice, r.text)
        assert r.json()["tool_choice"] == choice
    assert "Tools: get_time</s>" in front.prompts[-1]   # allowed_tools: that one only
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "tools": TOOLS,
                                         "tool_choice": {"type": "function", "name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_codex_s_request_shape_is_served(http, front, caplog):
    """What the Codex CLI sends on its first turn: function tools grouped in a
    `namespace` (offered as the functions they hold), a hosted `web_search` (left
    out, said once in the log), `client_metadata`, `include` of encrypted reasoning,
    `reasoning.summary`, `store: false`, `prompt_cache_key`, streamed."""
    front.reply = "Plain."
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                 "tools": [{"type": "function", "name": "close_agent", "strict": False,
                            "parameters": {"type": "object", "properties": {
                                "target": {"type": "string"}}, "required": ["target"],
                                "additionalProperties": False}}]}
    body = {"model": "m", "input": [{"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "hi"}]}],
            "instructions": "You are a coding agent.", "stream": True, "store": False,
            "tools": [TOOLS[1], namespace, {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "session-1",
            "client_metadata": {"x-codex-turn-metadata": "{}", "session_id": "s"}}
    with caplog.at_level("INFO"):
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert "response.completed" in r.text
        assert http.post("/v1/responses", json=body).status_code == 200
    assert "Tools: get_time close_agent</s>" in front.prompts[-1]
    notes = [m for m in caplog.messages if "web_search" in m]
    assert len(notes) == 1 and "hosted tool" in notes[0]


def test_unknown_or_unsupported_fields_are_400s_naming_them(http):
    for extra, param in (({"frobnicate": 1}, "frobnicate"), ({"background": True}, "background"),
                         ({"truncation": "auto"}, "truncation")):
        r = http.post("/v1/responses", json={"model": "m", "input": "hi", **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"].startswith(param.split(".")[0]), r.json()
    r = http.post("/v1/responses", json={"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.0"
    r = http.post("/v1/responses", json={"model": "m", "input": [
        {"type": "item_reference", "id": "msg_1"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0"
    assert "'function_call_output'" in r.json()["error"]["message"]
    r = http.post("/v1/responses", json={"model": "m", "input": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = http.post("/v1/responses", json={"model": "other", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_logprobs_come_with_the_text_when_included(oai, front):
    front.reply = "Plain."
    r = oai.responses.create(model="m", input="hi", include=["message.output_text.logprobs"],
                             top_logprobs=0)
    part = r.output[0].content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs).strip()


class HoldingFront(ScriptedFront):
    """Answers with the first tokens of its reply, then holds (the request runs on)."""

    async def _play(self, req) -> None:
        ids = self.core.codec.tokenizer.encode(self.reply, add_special_tokens=False)[:3]
        self.core.on_batch(TokenBatch([TokenEntry(req.rid, ids, [0.0] * len(ids))]))


def test_a_running_response_can_be_read_and_cancelled(tool_model):
    front = HoldingFront(TextCodec(tool_model))
    front.reply = "Some words that go on."
    with TestClient(build_app(Api(front, "m"))) as http:
        with http.stream("POST", "/v1/responses",
                         json={"model": "m", "input": "hi", "stream": True}) as stream:
            lines = stream.iter_lines()
            created = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
            rid = created["response"]["id"]
            next(line for line in lines if "response.output_text.delta" in line)
            assert http.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
            cancelled = http.post(f"/v1/responses/{rid}/cancel")
            rest = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert rest[-1]["type"] == "response.failed"
        assert rest[-1]["response"]["status"] == "cancelled"
        assert rest[-1]["response"]["output"][0]["status"] == "incomplete"
        again = http.post(f"/v1/responses/{rid}/cancel")
        assert again.status_code == 400 and "cancelled" in again.json()["error"]["message"]
        assert http.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        assert not front.core.requests   # the cancel aborted it in the core


def test_a_forced_call_sets_the_text_format_aside(http, front):
    r = http.post("/v1/responses", json={
        "model": "m", "input": "hi", "tools": TOOLS, "tool_choice": "required",
        "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 200, r.text


class FailingFront(ScriptedFront):
    """Answers with a few tokens, then the request fails (a worker error)."""

    async def _play(self, req) -> None:
        ids = self.core.codec.tokenizer.encode(self.reply, add_special_tokens=False)[:3]
        self.core.on_batch(TokenBatch([TokenEntry(req.rid, ids, [0.0] * len(ids))]))
        self.core.on_batch(TokenBatch([TokenEntry(
            req.rid, [], [], finish_reason="error", error="worker failed",
            usage=Usage(len(req.input_ids), 0, len(ids)))]))


def test_a_failure_is_response_failed_in_a_stream_and_a_500_otherwise(tool_model):
    front = FailingFront(TextCodec(tool_model))
    front.reply = "Some words that go on."
    with TestClient(build_app(Api(front, "m"))) as http:
        r = http.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:")]
        assert events[-1]["type"] == "response.failed"
        failed = Response.model_validate(events[-1]["response"])
        assert failed.status == "failed" and "worker failed" in failed.error.message
        assert http.get(f"/v1/responses/{failed.id}").json()["status"] == "failed"
        r = http.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert r.status_code == 500 and "worker failed" in r.json()["error"]["message"]


def test_fields_without_effect_are_accepted_and_said_once_in_the_log(http, front, caplog):
    front.reply = "Plain."
    body = {"model": "m", "input": "hi", "user": "u1", "prompt_cache_key": "k",
            "service_tier": "auto", "text": {"verbosity": "low"},
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "metadata": {"run": "1"}}
    with caplog.at_level("INFO", logger="mlxd.http"):
        for _ in range(2):
            r = http.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"run": "1"}
    said = [m for m in caplog.messages if "accepted and ignored" in m]
    for name in ("user", "prompt_cache_key", "service_tier", "text.verbosity",
                 "reasoning.summary", "include reasoning.encrypted_content"):
        assert sum(f"responses: {name} is" in m for m in said) == 1, (name, said)
