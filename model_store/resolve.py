"""`--model` as a folder mlx_lm loads: a model folder as it is; the default model,
`demo` and GGUF files built or converted once into the cache first."""

from pathlib import Path
from typing import Callable

from .tiny import default_cache_dir


class ModelError(ValueError):
    """`--model` names nothing that can be served (the message says why)."""


def resolve_model(model: str, log: Callable[[str], None] = lambda message: None) -> str:
    """The model folder to serve; GGUF files and the default model are converted
    (once, into the cache) first. Raises ModelError."""
    cache = default_cache_dir()
    if not model:
        from .default_model import DefaultModelError, ensure_default_model

        try:
            return str(ensure_default_model(cache, log=log))
        except DefaultModelError as exc:
            raise ModelError(str(exc)) from exc
    if model == "demo":
        from .tiny import DEMO_SPEC, build_tiny_model, demo_model_path

        return str(build_tiny_model(demo_model_path(cache), DEMO_SPEC))
    if model.endswith(".gguf") and Path(model).is_file():
        from .gguf import GGUFError, cached_conversion

        try:
            return str(cached_conversion(model, cache))
        except GGUFError as exc:
            raise ModelError(str(exc)) from exc
    if not (Path(model) / "config.json").exists():
        raise ModelError(f"--model {model!r} is not a model folder (no config.json) "
                         "nor a .gguf file")
    return model


def served_name(asked: str, folder: str) -> str:
    """The model name the HTTP API reports by default: the name of the folder or file
    asked for (`demo` and the default model: the folder they resolved to)."""
    return Path(asked if asked and asked != "demo" else folder).name.removesuffix(".gguf")
