"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Types are strict (a string is not a number) and unknown fields are refused, so a
parameter this server does not implement is a 400 naming it, never silently ignored.
A field sent as null counts as not sent (`drop_nulls`), as OpenAI treats it. Values
are range-checked by the core (params.py), which knows what it can honour."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def drop_nulls(body):
    """Top-level fields sent as null are left out (the defaults apply)."""
    if isinstance(body, dict):
        return {k: v for k, v in body.items() if v is not None}
    return body


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Parameters both OpenAI endpoints take."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    timeout: float | None = None
    user: str | None = None                  # accepted, not used
    metadata: dict[str, str] | None = None   # accepted, not used


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None   # None: an assistant's tool calls only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # an earlier reply's thinking: not re-sent


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    enable_thinking: bool | None = None   # vLLM's shorthand for the template kwarg
    response_format: dict | None = None   # checked and compiled by the core


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None   # the legacy form: top candidates per token


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
