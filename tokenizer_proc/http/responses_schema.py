"""The request body of OpenAI's Responses API (`POST /v1/responses`), as pydantic models.

The body is strict like openai_schema.py's: an unknown top-level field is a 400 naming
it. A few fields OpenAI's clients send are accepted and have no effect here, each
marked where it is declared. The parameters sent on as they are (temperature, top_p
and the extensions every OpenAI body takes: top_k, seed, stop, ...) have their fields
made from their declarations (protocol/sampling.py). Input items are typed by their
`type` (a message may leave it out); an item's fields that do not change what the
model reads (ids, statuses, an SDK's bookkeeping) are ignored rather than refused, so
that a client can send back the items it was given, whatever it added to them."""

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from .openai_schema import PASSED, Strict, passed_fields

LOGPROBS = "message.output_text.logprobs"   # the `include` value that asks for logprobs


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Item(Loose):
    id: str | None = None   # kept to list the item back (input_items)


class InputText(Loose):
    type: Literal["input_text", "output_text", "text"]
    text: str


class Refusal(Loose):
    type: Literal["refusal"]
    refusal: str


def by_type(*names: str) -> Discriminator:
    """Tells a union's models apart by their `type` (a message's may be left out); an
    unknown type (an image part, a hosted tool's item) is a 400 naming the place. The
    tags are spelled `type:NAME`, which the error's location leaves out (errors.py)."""
    listed = ", ".join(map(repr, names))
    return Discriminator(lambda v: f"type:{_type(v) or 'message'}",
                         custom_error_type="unsupported_type",
                         custom_error_message=f"type must be one of {listed} (this server "
                         "reads text, and no hosted tool's items)")


# A text, or a list: the error of the form sent is the one reported.
TEXT_OR_LIST = Discriminator(lambda v: "str" if isinstance(v, str) else "list")

Part = Annotated[Union[Annotated[InputText, Tag("type:input_text")],
                       Annotated[InputText, Tag("type:output_text")],
                       Annotated[InputText, Tag("type:text")],
                       Annotated[Refusal, Tag("type:refusal")]],
                 by_type("input_text", "output_text", "text", "refusal")]
Content = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[Part], Tag("list")]],
                    TEXT_OR_LIST]
Output = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[InputText], Tag("list")]],
                   TEXT_OR_LIST]


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(Item):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str   # JSON text


class FunctionCallOutputItem(Item):
    """The client's result of a call: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: Output


class ReasoningItem(Item):
    """An earlier reply's thinking: not re-sent to the model (as chat's
    `reasoning_content`)."""

    type: Literal["reasoning"]


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("type:message")],
          Annotated[FunctionCallItem, Tag("type:function_call")],
          Annotated[FunctionCallOutputItem, Tag("type:function_call_output")],
          Annotated[ReasoningItem, Tag("type:reasoning")]],
    by_type("message", "function_call", "function_call_output", "reasoning")]
Input = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[InputItem], Tag("list")]],
                  TEXT_OR_LIST]


def _type(value) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


def callable_tools(tools) -> tuple[list, list[str]]:
    """A request's `tools` as the function tools the model is offered, and the types
    of the hosted ones left out (web_search, file_search, ...: this server runs none).
    A `namespace` tool (Codex's) offers the function tools it groups."""
    functions, hosted = [], []
    for tool in tools:
        kind = _type(tool)
        if kind == "namespace" and isinstance(tool, dict):
            inner, more = callable_tools(tool.get("tools") or [])
            functions += inner
            hosted += more
        elif kind == "function":
            functions.append(tool)
        else:
            hosted.append(str(kind))
    return functions, hosted


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class AllowedTools(Strict):
    """Only these of `tools` may be called, `mode` as tool_choice says."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1)


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainFormat(Strict):
    type: Literal["text", "json_object"]


class TextConfig(Strict):
    format: Annotated[JsonSchemaFormat | PlainFormat, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # IGNORED


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None   # IGNORED
    generate_summary: Literal["auto", "concise", "detailed"] | None = None   # the old name


class StreamOptions(Strict):
    include_obfuscation: bool | None = None   # IGNORED


class Model(Strict):
    model: str | None = None


NO_EFFECT = "no effect on a local server"
# The fields accepted with no effect here (said once in the log, compat.Compat.note).
IGNORED = {("user",): NO_EFFECT, ("safety_identifier",): NO_EFFECT,
           ("prompt_cache_key",): "prefix caching is automatic",
           ("prompt_cache_retention",): "the prefix cache keeps what fits",
           ("service_tier",): "one tier: " + NO_EFFECT,
           ("text", "verbosity"): "the model's own length is kept",
           ("reasoning", "summary"): "no reasoning summaries: the reasoning is given whole",
           ("reasoning", "generate_summary"): "no reasoning summaries",
           ("stream_options", "include_obfuscation"): "nothing is padded here",
           ("client_metadata",): NO_EFFECT}


class ResponsesRequest(passed_fields({name: name for name in PASSED}, Model)):
    input: Input = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None   # LOGPROBS is used; the others name hosted tools' data
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: Literal[False] | None = None   # background runs are not offered
    truncation: Literal["disabled"] | None = None   # too long is a 400, never cut
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict | None = None   # an extension, as chat's
    # IGNORED: they identify the end user, or steer OpenAI's own caching and tiers
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    client_metadata: dict | None = None   # Codex's: who sent it
    # the hosted tools' types `tools` named (`callable_tools`), left out
    hosted_tools: list[str] = Field(default_factory=list, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _offered_tools(cls, data):
        if isinstance(data, dict) and isinstance(data.get("tools"), list):
            functions, hosted = callable_tools(data["tools"])
            data = {**data, "tools": functions, "hosted_tools": hosted}
        return data
