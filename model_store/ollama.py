"""`ollama:NAME[:TAG]`: the GGUF file of a model Ollama has pulled, found through its
local manifests, with no Ollama process involved.

Ollama's store (`$OLLAMA_MODELS`, else `~/.ollama/models`) holds one manifest per
model and tag, `manifests/HOST/NAMESPACE/MODEL/TAG` (JSON, an OCI image manifest),
whose layer of media type MODEL_LAYER names the GGUF blob by digest:
`sha256:<hex>` is the file `blobs/sha256-<hex>`, with no `.gguf` suffix.
"""

import json
import os
from pathlib import Path

PREFIX = "ollama:"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"


class OllamaError(ValueError):
    """The name is not a pulled Ollama model with a GGUF layer (the message says why)."""


def models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def parse_name(text: str) -> tuple[tuple[str, str, str], str]:
    """`ollama:[[HOST/]NAMESPACE/]MODEL[:TAG]` as ((host, namespace, model), tag)."""
    name, _, tag = text.removeprefix(PREFIX).partition(":")
    parts = name.split("/")
    if not 1 <= len(parts) <= 3 or not all(parts) or ".." in parts:
        raise OllamaError(f"{text!r} is not an Ollama model name "
                          "(ollama:[[HOST/]NAMESPACE/]MODEL[:TAG])")
    defaults = [DEFAULT_HOST, DEFAULT_NAMESPACE][:3 - len(parts)]
    host, namespace, model = (*defaults, *parts)
    return (host, namespace, model), tag or DEFAULT_TAG


def find_blob(text: str, root: Path | None = None) -> Path:
    """The model blob (a GGUF file) of `text`, an `ollama:` name. Raises OllamaError."""
    root = root or models_dir()
    (host, namespace, model), tag = parse_name(text)
    folder = root / "manifests" / host / namespace / model
    manifest = folder / tag
    if not manifest.is_file():
        tags = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        present = f"its pulled tags: {', '.join(tags)}" if tags else \
            f"`ollama pull {text.removeprefix(PREFIX)}` fetches it"
        raise OllamaError(f"{text} is not pulled in Ollama's store ({root}); {present}")
    layers = _layers(manifest)
    digests = [layer.get("digest", "") for layer in layers
               if layer.get("mediaType") == MODEL_LAYER]
    if not digests:
        raise OllamaError(f"{text}: its manifest ({manifest}) has no model layer "
                          f"({MODEL_LAYER})")
    blob = root / "blobs" / digests[0].replace(":", "-", 1)
    if not blob.is_file():
        raise OllamaError(f"{text}: its model blob {blob} is missing")
    return blob


def _layers(manifest: Path) -> list[dict]:
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise OllamaError(f"cannot read the Ollama manifest {manifest}: {exc}") from None
    return [layer for layer in layers if isinstance(layer, dict)]


def display_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The shortest `ollama:` name that finds this manifest (Ollama's own short form)."""
    parts = [host, namespace, model]
    if host == DEFAULT_HOST:
        parts = parts[2:] if namespace == DEFAULT_NAMESPACE else parts[1:]
    return f"{PREFIX}{'/'.join(parts)}:{tag}"


def pulled_models(root: Path | None = None) -> list[tuple[str, int]]:
    """(`ollama:` name, bytes of its layers) of each pulled model with a model layer."""
    root = root or models_dir()
    rows = []
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        try:
            layers = _layers(manifest)
        except OllamaError:
            continue
        if any(layer.get("mediaType") == MODEL_LAYER for layer in layers):
            size = sum(int(layer.get("size") or 0) for layer in layers)
            rows.append((display_name(*manifest.relative_to(root / "manifests").parts), size))
    return sorted(rows)
