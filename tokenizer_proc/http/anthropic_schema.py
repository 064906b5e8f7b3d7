"""The request body of Anthropic's Messages API (`POST /v1/messages`): text, tools,
tool_use and tool_result blocks. Strict like openai_schema.py: an unknown field is a
400 naming it."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None   # a caching hint: prefix caching is automatic


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    name: str
    input_schema: dict
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(Strict):
    user_id: str | None = None


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None   # accepted, not used
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
