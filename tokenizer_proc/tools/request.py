"""A request's chat options (OpenAI names): `tools`, `tool_choice`,
`parallel_tool_calls`, `chat_template_kwargs`, `enable_thinking` and
`continue_final_message`, validated."""

from dataclasses import dataclass, field

MAX_TOOLS = 128
# apply_chat_template's own arguments: a template kwarg must not replace them
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                             "add_generation_prompt", "continue_final_message",
                             "continue_final",
                             "chat_template", "return_dict", "tokenizer_kwargs"})
CHOICES = ("auto", "none", "required")


class InvalidOptions(ValueError):
    """`param` names the option at fault (None: a message's shape, tools/messages.py)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ChatOptions:
    tools: list[dict] = field(default_factory=list)   # OpenAI's {"type": "function", ...}
    tool_choice: str = "auto"          # auto, none, required, or "function" (named)
    function: str | None = None        # the named function
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)
    continue_final: bool = False   # the last message is continued, not answered

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is parsed for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        """Whether the reply must be a call (required, or a named function)."""
        return self.calls_tools and self.tool_choice in ("required", "function")

    def callable_tools(self) -> list[dict]:
        """The tools the reply may call: all, or the named one."""
        if self.function is None:
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.function]

    def template_args(self) -> dict:
        """What the chat template gets besides the messages."""
        tools = {"tools": self.tools} if self.calls_tools else {}
        final = {"continue_final": True} if self.continue_final else {}
        return {**self.template_kwargs, **tools, **final}


def _tool(tool) -> dict:
    if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
            and isinstance(tool.get("function"), dict)):
        raise InvalidOptions('tools must be a list of {"type": "function", "function": '
                             '{"name", "description", "parameters"}}', "tools")
    function = dict(tool["function"])
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidOptions("tools: every function needs a name", "tools")
    parameters = function.setdefault("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidOptions(f"tools: the parameters of {function['name']!r} must be a "
                             "JSON schema object", "tools")
    return {"type": "function", "function": function}


def _tools(params: dict) -> list[dict]:
    tools = params.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidOptions(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    tools = [_tool(t) for t in tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidOptions("tools: function names must be unique", "tools")
    return tools


def _choice(params: dict, tools: list[dict]) -> tuple[str, str | None]:
    choice = params.get("tool_choice", "auto")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get(
            "type") == "function" else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise InvalidOptions("tool_choice names a function that is not in tools",
                                 "tool_choice")
        return "function", name
    if choice not in CHOICES:
        raise InvalidOptions(f"tool_choice must be one of {list(CHOICES)} or "
                             '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if choice == "required" and not tools:
        raise InvalidOptions("tool_choice 'required' needs tools", "tool_choice")
    return choice, None


def _template_kwargs(params: dict) -> dict:
    kwargs = params.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidOptions("chat_template_kwargs must be an object",
                             "chat_template_kwargs")
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise InvalidOptions(f"chat_template_kwargs may not set {reserved}",
                             "chat_template_kwargs")
    thinking = params.get("enable_thinking")
    if thinking is not None:
        if type(thinking) is not bool:
            raise InvalidOptions(f"enable_thinking must be true or false, got {thinking!r}",
                                 "enable_thinking")
        kwargs = {**kwargs, "enable_thinking": thinking}
    return kwargs


def chat_options(params: dict) -> ChatOptions:
    """The options in a request's params; InvalidOptions names what is wrong."""
    tools = _tools(params)
    choice, function = _choice(params, tools)
    flags = {name: params.get(name, default) for name, default in
             (("parallel_tool_calls", True), ("continue_final_message", False))}
    for name, value in flags.items():
        if type(value) is not bool:
            raise InvalidOptions(f"{name} must be true or false, got {value!r}", name)
    return ChatOptions(tools, choice, function, flags["parallel_tool_calls"],
                       _template_kwargs(params), flags["continue_final_message"])
