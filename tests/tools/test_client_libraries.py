"""The client libraries users run against an OpenAI-compatible server, unmodified, on
a real server: LangChain (`langchain-openai`: tools with a forced choice, structured
output by function calling and by JSON schema, the Responses API) and instructor
(TOOLS and JSON_SCHEMA modes). The tiny model's text is random: the forced calls and
schemas (the grammar keeps them valid) make the checks deterministic, and every
field is an enum or a boolean, so a random model cannot write an endless string. Its
template thinks (in <think>); thinking is turned off as each library lets its user
(reasoning effort "none"), since a random model allowed to think may think until the
token limit."""

from typing import Literal

import instructor
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from support import Server


class GetTime(BaseModel):
    """Tell the time in a zone."""
    zone: Literal["UTC", "CET"] = Field(description="the time zone")


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool


@pytest.fixture(scope="module")
def server(tool_model):
    server = Server(tool_model, "--kv-capacity", "8192", "--log-level", "warning",
                    "--tool-call-parser", "hermes")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(tool_model) -> str:
    return tool_model.rsplit("/", 1)[-1]


NO_THINKING = {"reasoning_effort": "none"}


def chat_model(server, model, **options) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=server.http_url + "/v1", api_key="none",
                      max_tokens=120, timeout=60, max_retries=0, **NO_THINKING, **options)


# ---- LangChain -------------------------------------------------------------------

def test_langchain_bind_tools_with_a_forced_choice_round_trips(server, model):
    llm = chat_model(server, model).bind_tools([GetTime], tool_choice="GetTime")
    first = llm.invoke([HumanMessage("What time is it?")])
    assert isinstance(first, AIMessage) and len(first.tool_calls) == 1
    [call] = first.tool_calls
    assert call["name"] == "GetTime" and call["args"]["zone"] in ("UTC", "CET")
    # the call and its result go back as history; the choice is forced again
    second = llm.invoke([HumanMessage("What time is it?"), first,
                         ToolMessage("12:00", tool_call_id=call["id"])])
    assert [c["name"] for c in second.tool_calls] == ["GetTime"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(server, model, method):
    llm = chat_model(server, model).with_structured_output(Weather, method=method)
    answer = llm.invoke("What is the weather in Paris?")
    assert isinstance(answer, Weather)


def test_langchain_on_the_responses_api(server, model):
    llm = chat_model(server, model, use_responses_api=True)
    reply = llm.invoke("Hello there")
    assert isinstance(reply, AIMessage)
    assert reply.usage_metadata["input_tokens"] > 0
    assert reply.usage_metadata["output_tokens"] > 0
    forced = llm.bind_tools([GetTime], tool_choice="GetTime").invoke("What time is it?")
    [call] = forced.tool_calls
    assert call["name"] == "GetTime" and call["args"]["zone"] in ("UTC", "CET")
    structured = llm.with_structured_output(Weather, method="json_schema").invoke(
        "What is the weather in Oslo?")
    assert isinstance(structured, Weather)


def test_langchain_streams_a_forced_call(server, model):
    llm = chat_model(server, model).bind_tools([GetTime], tool_choice="GetTime")
    chunks = list(llm.stream("What time is it?"))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    [call] = whole.tool_calls
    assert call["name"] == "GetTime" and call["args"]["zone"] in ("UTC", "CET")


# ---- instructor ------------------------------------------------------------------

@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_returns_its_response_model(server, model, mode):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as raw:
        client = instructor.from_openai(raw, mode=mode)
        weather, completion = client.chat.completions.create_with_completion(
            model=model, response_model=Weather, max_retries=0, max_tokens=120, **NO_THINKING,
            messages=[{"role": "user", "content": "What is the weather in Rome?"}])
    assert isinstance(weather, Weather)
    assert completion.usage.prompt_tokens > 0


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_async_client(server, model, mode):
    import asyncio

    async def ask():
        async with openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="none",
                                      timeout=60, max_retries=0) as raw:
            client = instructor.from_openai(raw, mode=mode)
            return await client.chat.completions.create(
                model=model, response_model=GetTime, max_retries=0, max_tokens=120,
                **NO_THINKING,
                messages=[{"role": "user", "content": "What time is it?"}])

    assert isinstance(asyncio.run(ask()), GetTime)
