"""The request body of Anthropic's Messages API (`POST /v1/messages`, and
`/v1/messages/count_tokens`'s): text, tools, tool_use and tool_result blocks. Strict
like openai_schema.py: an unknown field is a 400 naming it, once the compatibility
policy (compat.py) has dealt with the API's fields it ignores, maps or refuses. The parameters it sends on as they are have their fields made from
their declarations (protocol/sampling.py), unless typed here (max_tokens, required;
stop_sequences, a list; temperature, which this API bounds to [0, 1])."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxd.protocol import PARAMS

from .openai_schema import passed_fields

# The fields sent to the core as they are: body field -> the core's parameter.
PASSED = {p.anthropic: name for name, p in PARAMS.items() if p.anthropic}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(Strict):
    """A cache breakpoint: the prompt's prefix up to this block is pinned in the
    prefix cache for `ttl` (anthropic_api.py)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant", "system"]   # system: joins the system prompt
    content: str | list[Block]


class Tool(Strict):
    name: str
    input_schema: dict
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Model(Strict):
    model: str


class MessagesRequest(passed_fields(PASSED, Model)):
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    enable_thinking: bool | None = None    # from `thinking` (compat.py)
    thinking_budget: int | None = None     # from `thinking.budget_tokens` (compat.py)
    response_format: dict | None = None    # from `output_config.format` (compat.py)


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a request as it would be sent, max_tokens aside."""

    max_tokens: int | None = Field(default=None, ge=1)
