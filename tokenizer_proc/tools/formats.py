"""The tool-call formats, each a BlockParser: every format mlx_lm has, parsed by its
module (`mlx_lm_formats.py`), except where ours does better, and the one it lacks:

- hermes (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  mlx_lm's `json_tools` (both names)
- qwen3_coder: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...`
  `</function></tool_call>` (ours: mlx_lm's reads a string parameter `null` as None
  and takes text between parameters for a call)
- mistral (ours: mlx_lm's takes the id of `NAME[CALL_ID]ID[ARGS]` for the name):
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (newer tokenizers)
  `[TOOL_CALLS]NAME[ARGS]{...}` per call
- llama3_json (Llama 3.1+; mlx_lm has none): the reply is `{"name": ...,
  "parameters": {...}}` (calls separated by `;`), optionally after `<|python_tag|>`
- the rest as mlx_lm's modules write them (`python -m mlxd.runtime.flags` lists them)
"""

import json
import re

from .blocks import BlockParser
from .markup import make_call
from .mlx_lm_formats import NAMES, block_parser, calls_of


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3Coder(BlockParser):
    START = ("<tool_call>",)
    END = "</tool_call>"

    def parse(self, body):
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name = match.group(1).strip()
        params = _PARAMETER.findall(match.group(2))
        if _PARAMETER.sub("", match.group(2)).strip():
            return None   # text between parameters: not this format
        types = self._types(name)
        arguments = {key.strip(): _value(raw, types.get(key.strip())) for key, raw in params}
        call = make_call(name, arguments)
        return None if call is None else [call]

    def _types(self, name: str) -> dict:
        """The JSON types of the named tool's parameters, as its schema declares them."""
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == name:
                props = (function.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def _value(raw: str, kind) -> object:
    """A parameter's text as its declared type: strings as written (less the newline
    the format puts around values), anything else as JSON where it parses."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class Mistral(BlockParser):
    START = ("[TOOL_CALLS]",)
    END = None

    def parse(self, body):
        calls = []
        for piece in body.split("[TOOL_CALLS]"):
            piece = piece.strip()
            if piece.startswith("["):
                listed = _json(piece)
                found = calls_of(listed) if isinstance(listed, list) else None
            elif "[ARGS]" in piece:
                name, arguments = piece.split("[ARGS]", 1)
                call = make_call(name.split("[CALL_ID]")[0].strip(), arguments.strip())
                found = None if call is None else [call]
            else:
                found = None
            if found is None:
                return None
            calls += found
        return calls


class Llama3Json(BlockParser):
    START = ("<|python_tag|>",)
    END = None

    def find_start(self, text):
        if not self.calls and not self._sent_any() and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip()), 0   # the reply is JSON: a call
        return super().find_start(text)

    def hold(self, text):
        if not self._sent_any() and not text.strip():
            return len(text)   # the reply has not begun: it may begin with "{"
        return super().hold(text)

    def _sent_any(self) -> bool:
        return not self._quiet

    def parse(self, body):
        decoder, objects, at = json.JSONDecoder(), [], 0
        body = body.strip()
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return None
            objects.append(obj)
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return calls_of(objects)


OURS: dict[str, type[BlockParser]] = {
    "qwen3_coder": Qwen3Coder, "mistral": Mistral, "llama3_json": Llama3Json}
# Names of one format: mlx_lm's name for what we call it.
SAME_FORMAT = {"json_tools": "hermes"}
PARSERS: dict[str, type[BlockParser]] = {
    "hermes": block_parser("json_tools"),
    **{name: block_parser(name) for name in NAMES if name not in OURS},
    **OURS}
