"""Tools for a chat template that does not render them (SmolLM2's, the default
model's): the request's tools go into the system prompt, with the call format of the
parser the reply is read with, as llama.cpp's generic tool format does; without that
`tool_choice: auto` could never call, the model not being told the tools exist."""

import itertools
import json
import logging
from typing import Callable

from .formats import SAME_FORMAT
from .mlx_lm_formats import markers

log = logging.getLogger("mlxd.tokenizer")

# How each format's call is written, as the model families' own templates teach it.
CALL_FORMATS = {
    "hermes": "For each function call, return a json object with function name and "
              "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "qwen3_coder": "To call a function, reply in this format:\n<tool_call>\n"
                   "<function=example_function_name>\n<parameter=example_parameter>\n"
                   "value\n</parameter>\n</function>\n</tool_call>",
    "mistral": "To call functions, reply with [TOOL_CALLS] and a JSON list of calls:\n"
               '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]',
    "llama3_json": "To call a function, reply with a JSON object only:\n"
                   '{"name": <function-name>, "parameters": <args-json-object>}',
}
Render = Callable[..., str]   # (messages, **template_args) -> the chat's text


def call_format(tool_parser: str) -> str:
    """How to call, for the prompt: the family's wording, or (mlx_lm's other formats,
    whose templates render tools themselves) the format's markers."""
    tool_parser = SAME_FORMAT.get(tool_parser, tool_parser)
    if tool_parser in CALL_FORMATS:
        return CALL_FORMATS[tool_parser]
    start, end = markers(tool_parser)
    return f"To call a function, write the call between {start} and {end or 'the end'}."


def tools_prompt(tools: list[dict], tool_parser: str) -> str:
    """The system prompt's part that shows `tools` (OpenAI's shape) and how to call
    them in `tool_parser`'s format (Hermes's wording, as Qwen 2.5's template has it)."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>\n{signatures}\n</tools>\n\n{call_format(tool_parser)}")


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` ending their system message (one is put first if none)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_with_tools(render: Render, messages: list[dict], args: dict,
                      tool_parser: str) -> tuple[str, bool]:
    """The chat's text with `args` (template arguments, `tools` among them or not),
    and whether the tools had to be put in the system prompt: they are when the
    template renders the same text without them."""
    text = render(messages, **args)
    tools = args.get("tools")
    if not tools:
        return text, False
    bare = {k: v for k, v in args.items() if k != "tools"}
    if render(messages, **bare) != text:
        return text, False
    return render(with_system_text(messages, tools_prompt(tools, tool_parser)), **bare), True


class ChatRenderer:
    """A model's chats as text (`render`: its template), tools shown either way; says
    once, in the log, that its template leaves them out."""

    def __init__(self, render: Render, tool_parser: str):
        self._render = render
        self.tool_parser = tool_parser
        # next() on a count is atomic, so prompts encoded on several threads log once
        self._injected = itertools.count()

    def __call__(self, messages: list[dict], args: dict) -> str:
        text, injected = render_with_tools(self._render, messages, args, self.tool_parser)
        if injected and next(self._injected) == 0:
            log.info("the chat template does not render tools: they are put in the "
                     "system prompt, in the %s format the replies are parsed in",
                     self.tool_parser)
        return text
