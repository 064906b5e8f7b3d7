"""`--model` as a folder mlx_lm loads: a model folder as it is; a Hugging Face id
through the Hugging Face cache (hub.py); the default model, `demo`, GGUF files
(a file, a folder holding one as LM Studio keeps them, a hub repository's, an Ollama
blob: ollama.py) built or converted once into the cache first."""

from pathlib import Path
from typing import Callable

from .tiny import default_cache_dir

GGUF_MAGIC = b"GGUF"


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
    return _converted(fetch_model(model, log), cache)


def fetch_model(model: str, log: Callable[[str], None] = lambda message: None) -> Path:
    """The local model folder or GGUF file `model` names (a path, `ollama:NAME[:TAG]`
    or a Hugging Face id, downloaded into its cache if need be). Raises ModelError."""
    from .hub import HubError, parse_hub_id, resolve_hub
    from .ollama import PREFIX, OllamaError, find_blob

    path = Path(model)
    try:
        if model.startswith(PREFIX):
            return find_blob(model)
        if path.exists():
            return _local(path)
        if parse_hub_id(model) is not None:
            return resolve_hub(model, log=log)
    except (HubError, OllamaError) as exc:
        raise ModelError(str(exc)) from None
    raise ModelError(f"--model {model!r}: no such file or folder, nor a Hugging Face id "
                     "(ORG/NAME), nor ollama:NAME")


def _local(path: Path) -> Path:
    """A model folder, a GGUF file, or the one GGUF file in a folder without config.json."""
    from .hub import gguf_files, is_split_gguf

    if path.is_file() or (path / "config.json").exists():
        return path
    found = gguf_files(p.name for p in path.iterdir())
    if len(found) == 1 and not is_split_gguf(found[0]):
        return path / found[0]
    if len(found) > 1:
        raise ModelError(f"--model {str(path)!r} holds several GGUF files; name one: "
                         f"{', '.join(found)}")
    raise ModelError(f"--model {str(path)!r} is not a model folder (no config.json), nor "
                     "a GGUF file, nor a folder holding one" +
                     (f" ({found[0]} is split in parts, which mlxd does not serve)"
                      if found else ""))


def _converted(path: Path, cache: Path) -> str:
    """`path` if it is a folder, else the folder its GGUF file converts to."""
    if path.is_dir():
        return str(path)
    if not is_gguf(path):
        raise ModelError(f"--model {str(path)!r} is not a GGUF file (it does not start "
                         f"with {GGUF_MAGIC.decode()}) nor a model folder")
    from .gguf import GGUFError, cached_conversion

    try:
        return str(cached_conversion(path, cache))
    except GGUFError as exc:
        raise ModelError(str(exc)) from exc


def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic (Ollama's blobs have no .gguf suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def served_name(asked: str, folder: str) -> str:
    """The model name the HTTP API reports by default: an id (hub, `ollama:`) as it
    was asked for, as vLLM does; the default model's own name; else the name of the
    folder or file asked for (`demo`: the folder it resolved to)."""
    from .default_model import NAME
    from .hub import parse_hub_id
    from .ollama import PREFIX

    if not asked:
        return NAME
    if asked.startswith(PREFIX) or (not Path(asked).exists() and parse_hub_id(asked)):
        return asked
    return Path(asked if asked and asked != "demo" else folder).name.removesuffix(".gguf")


def local_models() -> list[tuple[str, str, int]]:
    """(what `--model` takes, format, bytes on disk) of each model already here: in the
    Hugging Face cache, in Ollama's store, and mlxd's own cache (built or converted)."""
    from .hub import cached_models
    from .ollama import pulled_models

    own = default_cache_dir()
    configs = [*own.glob("*/config.json"), *own.glob("gguf/*/config.json")]
    folders = sorted(config.parent for config in configs)
    return [*cached_models(), *[(name, "gguf", size) for name, size in pulled_models()],
            *[(str(folder), _own_format(folder), _bytes(folder)) for folder in folders]]


def _own_format(folder: Path) -> str:
    import json

    from .hub import snapshot_format

    try:
        converted = "gguf" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        converted = False
    return "converted-gguf" if converted else snapshot_format(list(folder.iterdir()))


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
