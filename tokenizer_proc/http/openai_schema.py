"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Types are strict (a string is not a number) and unknown fields are refused, so a
parameter this server does not implement is a 400 naming it, never silently ignored;
the fields of the APIs that are ignored, mapped or refused by the compatibility policy
are dealt with before (compat.py), and nulls dropped at every depth. Values
are range-checked by the core (params.py), which knows what it can honour. The
parameters sent on as they are have their fields made from their declarations
(protocol/sampling.py); the others are declared here and mapped by the routes."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from mlxd.protocol import PARAMS

# A body field's type for each kind of parameter sent on as it is.
KIND_TYPES = {"number": float, "integer": int, "flag": bool, "stop": str | list[str],
              "token_ids": list[int]}
# Sent to the core under the same name whenever a body has them; the core validates them.
PASSED = tuple(name for name, p in PARAMS.items() if p.openai)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def passed_fields(names: dict[str, str], base: type[BaseModel]) -> type[BaseModel]:
    """`base` with an optional field per parameter in `names` (field name -> the
    parameter's), typed by its kind."""
    fields = {field: (KIND_TYPES[PARAMS[name].kind] | None, None)
              for field, name in names.items()}
    return create_model(f"{base.__name__}Passed", __base__=base, **fields)


class StreamOptions(Strict):
    include_usage: bool = False


class Model(Strict):
    model: str


class Sampling(passed_fields({name: name for name in PASSED}, Model)):
    """Parameters both OpenAI endpoints take: those sent on as they are (a field of
    its name per declared parameter), and these."""

    max_tokens: int | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None   # checked and compiled by the core


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
    # vLLM's: a final assistant message is continued (rendered open) unless
    # add_generation_prompt is true or continue_final_message false
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None


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
