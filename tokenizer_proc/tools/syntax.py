"""Which tool-call format and reasoning markup a model writes: read from its chat
template unless the server's flags name them (`--tool-call-parser`,
`--reasoning-parser`)."""

from dataclasses import dataclass

from .blocks import BlockParser
from .formats import PARSERS, SAME_FORMAT
from .mlx_lm_formats import Vocab, inferred, markers
from .output import OutputParser
from .reasoning import CLOSE, OPEN, ThinkParser

AUTO = "auto"
REASONING_PARSERS = ("think", "none")
FALLBACK_TOOL_PARSER = "hermes"   # for templates that show no format: plain-text markers
# Marker texts per format: where they are special tokens, decoding must keep them.
# mlx_lm's formats: their start and end markers, and those inside a block below.
MARKERS = {"hermes": ("<tool_call>", "</tool_call>"),
           "qwen3_coder": ("<tool_call>", "</tool_call>"),
           "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
           "llama3_json": ("<|python_tag|>",)}
INNER_MARKERS = {"kimi_k2": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                             "<|tool_call_end|>"),
                 "kimi_k3": ("<|open|>", "<|close|>", "<|sep|>"),
                 "gemma4": ('<|"|>',), "function_gemma": ("<escape>",),
                 "glm47": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
                 "laguna": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
                 "longcat": ("<longcat_arg_key>", "</longcat_arg_key>",
                             "<longcat_arg_value>", "</longcat_arg_value>")}


def markers_of(tool_parser: str) -> tuple[str, ...]:
    """The marker texts of format `tool_parser` (a name in PARSERS)."""
    if tool_parser in MARKERS:
        return MARKERS[tool_parser]
    start, end = markers(tool_parser)
    return (start, *((end,) if end else ()), *INNER_MARKERS.get(tool_parser, ()))


@dataclass(frozen=True)
class OutputSyntax:
    tool_parser: str = FALLBACK_TOOL_PARSER
    reasoning: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        """Texts the parsers look for: kept in the text even where they are special."""
        return markers_of(self.tool_parser) + ((OPEN, CLOSE) if self.reasoning else ())

    def parser(self, tools: list[dict] | None, chat: bool,
               prompt_thinks: bool = False) -> OutputParser | None:
        """The parser of one reply: tool calls when `tools` is not None (the request
        may call them), thinking when the server parses it and the prompt is a chat
        (a raw prompt's text is returned as it is); None when neither."""
        reasoning = self.reasoning and chat
        if tools is None and not reasoning:
            return None
        block: BlockParser | None = None if tools is None else PARSERS[self.tool_parser](tools)
        think = ThinkParser(prompt_thinks) if reasoning else None
        return OutputParser(block, think)


def tool_parser_of(template: str, vocab: Vocab | None = None) -> str:
    """The tool-call format a chat template (and vocabulary) shows: mlx_lm's choice
    where it makes one, else ours (a looser Qwen3-Coder test, Hermes, Llama);
    FALLBACK_TOOL_PARSER if none."""
    found = inferred(template, vocab)
    if found is not None:
        return SAME_FORMAT.get(found, found)
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return FALLBACK_TOOL_PARSER


def resolve(template: str | None, tool_parser: str = AUTO,
            reasoning_parser: str = AUTO, vocab: Vocab | None = None) -> OutputSyntax:
    """The syntax for a model with chat template `template` (None: it has none) and
    vocabulary `vocab()` (read only if the template shows no format); ValueError for
    a parser name that does not exist."""
    if tool_parser != AUTO and tool_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser {tool_parser!r}: one of "
                         f"{[AUTO, *PARSERS]}")
    if reasoning_parser != AUTO and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning_parser!r}: one of "
                         f"{[AUTO, *REASONING_PARSERS]}")
    template = template or ""
    tools = tool_parser_of(template, vocab) if tool_parser == AUTO else tool_parser
    thinks = OPEN in template if reasoning_parser == AUTO else reasoning_parser == "think"
    return OutputSyntax(tools, thinks)
