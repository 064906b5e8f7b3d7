"""The request body of Anthropic's Messages API (`POST /v1/messages`): text content
only. Strict like openai_schema.py: an unknown field is a 400 naming it."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None   # a caching hint: prefix caching is automatic


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


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
