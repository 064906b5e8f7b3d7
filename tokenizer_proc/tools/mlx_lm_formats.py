"""mlx_lm's tool-call parsers (`mlx_lm/tool_parsers/`, one module a format with
`tool_call_start`, `tool_call_end` and `parse_tool_call(text, tools)`) and its choice
of one from a chat template (`tokenizer_utils._infer_tool_parser`), loaded without
MLX: importing `mlx_lm.tool_parsers.X` runs `mlx_lm/__init__.py`, which imports
mlx.core (the tokenizer process must not), so the modules are loaded from their files
under a package of their own. The only module that touches mlx_lm's internals."""

import importlib
import importlib.util
import sys
import types
from functools import cache
from pathlib import Path
from typing import Callable

from .blocks import BlockParser
from .markup import ToolCall, make_call

_PACKAGE = "mlxd_mlx_lm_tool_parsers"   # mlx_lm/tool_parsers/, without mlx_lm/__init__


def _mlx_lm_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")   # finds the package without running it
    assert spec is not None and spec.origin is not None, "mlx_lm is a dependency"
    return Path(spec.origin).parent


def _package() -> types.ModuleType:
    """The package the parser modules load into (their relative imports resolve in it)."""
    if _PACKAGE not in sys.modules:
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [str(_mlx_lm_dir() / "tool_parsers")]
        sys.modules[_PACKAGE] = package
    return sys.modules[_PACKAGE]


NAMES: tuple[str, ...] = tuple(sorted(
    p.stem for p in (_mlx_lm_dir() / "tool_parsers").glob("*.py") if p.stem != "__init__"))


@cache
def module(name: str) -> types.ModuleType:
    """mlx_lm's parser module `name` (one of NAMES)."""
    _package()
    return importlib.import_module(f"{_PACKAGE}.{name}")


def markers(name: str) -> tuple[str, str | None]:
    """The texts that open and close a call block of format `name` (None: the block
    runs to the end of the reply, as mlx_lm's empty end marker says)."""
    parser = module(name)
    return parser.tool_call_start, parser.tool_call_end or None


Vocab = Callable[[], dict[str, int]]   # a tokenizer's get_vocab: called only if needed


class _ShownTokenizer:
    """What `_infer_tool_parser` reads of a tokenizer: its template and vocabulary."""

    def __init__(self, template: str, vocab: Vocab | None):
        self.chat_template = template
        self.get_vocab = vocab or dict


@cache
def _tokenizer_utils() -> types.ModuleType:
    """mlx_lm/tokenizer_utils.py (imports transformers only), loaded from its file."""
    name = f"{_PACKAGE}_tokenizer_utils"
    spec = importlib.util.spec_from_file_location(name, _mlx_lm_dir() / "tokenizer_utils.py")
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def inferred(template: str, vocab: Vocab | None = None) -> str | None:
    """The format mlx_lm picks for a chat template (and, where that shows none, the
    vocabulary `vocab()` returns); None if none."""
    return _tokenizer_utils()._infer_tool_parser(_ShownTokenizer(template, vocab))


def calls_of(found) -> list[ToolCall] | None:
    """Calls from what a parser returned: a call or a list of calls, each a dict with a
    name and arguments (or parameters, as Llama writes them); None if not that."""
    found = found if isinstance(found, list) else [found]
    calls = []
    for obj in found:
        if not isinstance(obj, dict):
            return None
        call = make_call(obj.get("name"), obj.get("arguments", obj.get("parameters")))
        if call is None:
            return None
        calls.append(call)
    return calls or None


class MlxLmFormat(BlockParser):
    """A block between the format's markers, parsed by mlx_lm's `parse_tool_call`
    (which raises on a block it cannot read: that block is passed on as content)."""

    NAME = ""

    def parse(self, body):
        try:
            found = module(self.NAME).parse_tool_call(body, self.tools)
        except Exception:   # mlx_lm's parsers raise whatever their parsing hits
            return None
        return calls_of(found)


def block_parser(name: str) -> type[BlockParser]:
    """The BlockParser of mlx_lm's format `name`."""
    start, end = markers(name)
    return type(f"MlxLm_{name}", (MlxLmFormat,), {"NAME": name, "START": (start,), "END": end})
