"""The Responses API on a real server (the tiny random-weight model whose template
renders tools), through the `openai` client and the OpenAI Agents SDK on its default
Responses provider. The model's text is random: forced calls (the grammar makes them
valid) and constrained text make the checks deterministic; thinking is turned off
(reasoning effort none), since a random model allowed to think may think until the
token limit."""

import asyncio
import json
from typing import Literal

import openai
import pytest
from openai.types.responses import Response

from structured_support import SCHEMA, satisfies
from support import Server

TOOLS = [{"type": "function", "name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}]
NO_THINKING = {"effort": "none"}


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


@pytest.fixture(scope="module")
def model(tool_model) -> str:
    return tool_model.rsplit("/", 1)[-1]


def valid(response) -> Response:
    return Response.model_validate(response.model_dump(mode="json", exclude_unset=True))


def test_streamed_and_whole_agree_and_usage_counts_cached_tokens(oai, model):
    ask = dict(model=model, input="Hello there", max_output_tokens=12, reasoning=NO_THINKING)
    whole = valid(oai.responses.create(**ask))
    with oai.responses.stream(**ask) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = valid(events[-1].response)
    assert "".join(deltas) == final.output_text == whole.output_text
    assert whole.status == final.status
    if whole.status == "incomplete":   # at max_output_tokens, as OpenAI ends it
        assert events[-1].type == "response.incomplete"
        assert whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage.output_tokens == 12
    else:
        assert events[-1].type == "response.completed"
    assert whole.usage.input_tokens > 0
    assert final.usage.input_tokens_details.cached_tokens > 0   # the same prompt again


def test_a_forced_call_round_trip_through_previous_response_id(oai, model):
    first = valid(oai.responses.create(model=model, input="What time is it?", tools=TOOLS,
                                       tool_choice="required", reasoning=NO_THINKING,
                                       parallel_tool_calls=False, max_output_tokens=100))
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert first.status == "completed"
    named = {"type": "function", "name": "get_time"}
    second = valid(oai.responses.create(
        model=model, previous_response_id=first.id, tools=TOOLS, tool_choice=named,
        reasoning=NO_THINKING, max_output_tokens=100, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]))
    assert second.previous_response_id == first.id
    assert [i.type for i in second.output if i.type == "function_call"] == ["function_call"]
    assert second.usage.input_tokens > first.usage.input_tokens   # the history came along
    assert oai.responses.retrieve(second.id).output_text == second.output_text


def test_text_format_json_schema_holds(oai, model):
    for seed in range(2):
        r = oai.responses.create(model=model, input="A person, please.", temperature=1.0,
                                 max_output_tokens=200, reasoning=NO_THINKING,
                                 extra_body={"seed": seed}, text={"format": {
                                     "type": "json_schema", "name": "person",
                                     "schema": SCHEMA, "strict": True}})
        assert r.status == "completed" and satisfies("json_schema", r.output_text), r.output_text


def test_the_sdk_parse_helper_gets_its_pydantic_type(oai, model):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: Literal["ann", "bob"]
        adult: bool

    r = oai.responses.parse(model=model, input="A person.", text_format=Person,
                            reasoning=NO_THINKING, max_output_tokens=100)
    assert isinstance(r.output_parsed, Person), r.output_text


def test_a_missing_previous_response_is_a_404(oai, model):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.create(model=model, input="hi", previous_response_id="resp_missing")
    assert exc.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_agent_calls_its_tool(server, model, streamed):
    """The Agents SDK's default provider (the Responses API) runs a one-tool agent; the
    call is forced (ModelSettings.tool_choice) and the run ends on the tool's result."""
    import agents
    from openai.types.shared import Reasoning

    agents.set_tracing_disabled(True)
    called = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        called.append(zone)
        return f"12:00 {zone}"

    agent = agents.Agent(
        name="clock", instructions="Tell the time.", tools=[get_time], model=model,
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="get_time", max_tokens=100,
                                            reasoning=Reasoning(effort="none")))

    async def run():
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="none",
                                    max_retries=0)
        config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client))
        try:
            if not streamed:
                return await agents.Runner.run(agent, "What time is it?", run_config=config)
            result = agents.Runner.run_streamed(agent, "What time is it?", run_config=config)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(called) == 1 and called[0] in ("UTC", "CET")
    assert result.final_output == f"12:00 {called[0]}"
    assert result.raw_responses[0].response_id.startswith("resp_")   # the Responses API
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem",
                                                            "ToolCallOutputItem"]


def test_an_agent_with_an_output_type_calls_then_answers_in_its_schema(server, model):
    """Two turns: the forced call (its text format set aside), then, tool_choice reset
    to auto by the SDK, the answer constrained to the output type's schema, with the
    whole history (the call and its output as items) sent back by the SDK."""
    import agents
    from openai.types.shared import Reasoning
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)

    class Answer(BaseModel):
        zone: Literal["UTC", "CET"]
        late: bool

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return f"23:00 {zone}"

    agent = agents.Agent(
        name="clock", instructions="Tell the time.", tools=[get_time], model=model,
        output_type=Answer, model_settings=agents.ModelSettings(
            tool_choice="get_time", max_tokens=100, reasoning=Reasoning(effort="none")))

    async def run():
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="none",
                                    max_retries=0)
        config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client))
        try:
            return await agents.Runner.run(agent, "What time is it?", run_config=config)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == 2
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
