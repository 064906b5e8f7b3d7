"""`ollama:NAME[:TAG]` through Ollama's manifests, and model folders as LM Studio keeps
them (GGUF files in a folder), laid out by the tests; no Ollama, no network."""

import hashlib
import json
from pathlib import Path

import pytest

from mlxd.model_store.gguf import cached_conversion
from mlxd.model_store.ollama import (MODEL_LAYER, OllamaError, display_name, find_blob,
                                     parse_name, pulled_models)
from mlxd.model_store.resolve import ModelError, fetch_model, resolve_model, served_name
from test_gguf import write_model_gguf

TEMPLATE_LAYER = "application/vnd.ollama.image.template"


@pytest.fixture(scope="module")
def tiny_gguf(llama_model, tmp_path_factory) -> Path:
    """A tiny llama as a Q8_0 GGUF file (gguf's writer)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf"
    write_model_gguf(Path(llama_model), path, "Q8_0")
    return path


def blob(root: Path, data: bytes) -> dict:
    """Store `data` as Ollama does; its layer's digest and size."""
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def pull(root: Path, name: str, tag: str, gguf: bytes | None,
         host: str = "registry.ollama.ai") -> Path:
    """Lay out what `ollama pull NAME:TAG` leaves: the blobs and the manifest (a model
    layer holding `gguf` unless None, and a template layer)."""
    layers = [{"mediaType": TEMPLATE_LAYER, **blob(root, b"{{ .Prompt }}")}]
    if gguf is not None:
        layers.insert(0, {"mediaType": MODEL_LAYER, **blob(root, gguf)})
    manifest = {"schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           **blob(root, b"{}")},
                "layers": layers}
    path = root / "manifests" / host / (name if "/" in name else f"library/{name}") / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def test_names_default_to_the_library_namespace_and_the_latest_tag():
    assert parse_name("ollama:qwen3") == (("registry.ollama.ai", "library", "qwen3"), "latest")
    assert parse_name("ollama:qwen3:8b") == (("registry.ollama.ai", "library", "qwen3"), "8b")
    assert parse_name("ollama:me/tiny:q8") == (("registry.ollama.ai", "me", "tiny"), "q8")
    assert parse_name("ollama:hf.co/org/Repo-GGUF:Q4_K_M") == \
        (("hf.co", "org", "Repo-GGUF"), "Q4_K_M")
    for bad in ("ollama:", "ollama:a/b/c/d", "ollama:a//b", "ollama:../x"):
        with pytest.raises(OllamaError, match="not an Ollama model name"):
            parse_name(bad)
    assert display_name("registry.ollama.ai", "library", "qwen3", "8b") == "ollama:qwen3:8b"
    assert display_name("registry.ollama.ai", "me", "t", "latest") == "ollama:me/t:latest"
    assert display_name("hf.co", "org", "R", "Q8_0") == "ollama:hf.co/org/R:Q8_0"


def test_the_model_layer_names_the_blob(tmp_path):
    pull(tmp_path, "tiny", "latest", b"GGUF one")
    pull(tmp_path, "tiny", "small", b"GGUF two")
    pull(tmp_path, "me/tiny", "latest", b"GGUF three")
    pull(tmp_path, "org/Tiny-GGUF", "Q8_0", b"GGUF four", host="hf.co")
    for name, data in [("ollama:tiny", b"GGUF one"), ("ollama:tiny:latest", b"GGUF one"),
                       ("ollama:tiny:small", b"GGUF two"), ("ollama:me/tiny", b"GGUF three"),
                       ("ollama:hf.co/org/Tiny-GGUF:Q8_0", b"GGUF four")]:
        found = find_blob(name, tmp_path)
        assert found.parent == tmp_path / "blobs" and found.read_bytes() == data
    assert [name for name, _ in pulled_models(tmp_path)] == [
        "ollama:hf.co/org/Tiny-GGUF:Q8_0", "ollama:me/tiny:latest", "ollama:tiny:latest",
        "ollama:tiny:small"]


def test_what_is_not_there_is_a_clear_error(tmp_path):
    pull(tmp_path, "tiny", "latest", b"GGUF")
    pull(tmp_path, "tiny", "q8", b"GGUF q8")
    pull(tmp_path, "nomodel", "latest", None)
    with pytest.raises(OllamaError, match=r"ollama:tiny:7b is not pulled .* its pulled tags: "
                                          r"latest, q8"):
        find_blob("ollama:tiny:7b", tmp_path)
    with pytest.raises(OllamaError, match=r"not pulled .*`ollama pull other` fetches it"):
        find_blob("ollama:other", tmp_path)
    with pytest.raises(OllamaError, match="has no model layer"):
        find_blob("ollama:nomodel", tmp_path)
    next((tmp_path / "blobs").glob(f"sha256-{hashlib.sha256(b'GGUF q8').hexdigest()}")).unlink()
    with pytest.raises(OllamaError, match="model blob .* is missing"):
        find_blob("ollama:tiny:q8", tmp_path)


def test_an_ollama_model_is_served_through_the_gguf_conversion(tiny_gguf, tmp_path,
                                                               monkeypatch):
    """OLLAMA_MODELS locates the store; the blob, with no .gguf suffix, is converted
    (once, keyed by its content) as the same GGUF file would be."""
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    pull(tmp_path / "ollama", "tiny", "q8", tiny_gguf.read_bytes())
    folder = resolve_model("ollama:tiny:q8")
    assert Path(folder) == cached_conversion(tiny_gguf, tmp_path / "cache")
    assert (Path(folder) / "config.json").exists()
    assert served_name("ollama:tiny:q8", folder) == "ollama:tiny:q8"
    with pytest.raises(ModelError, match="ollama:tiny is not pulled"):
        resolve_model("ollama:tiny")


def test_a_folder_holding_one_gguf_file_serves_it(tiny_gguf, tmp_path, monkeypatch):
    """LM Studio's layout: models/PUBLISHER/REPO/*.gguf (a vision projector beside it
    is not the model); several model files: an error naming them."""
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "lmstudio" / "models" / "org" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    (folder / "tiny-Q8_0.gguf").write_bytes(tiny_gguf.read_bytes())
    (folder / "mmproj-tiny-f16.gguf").write_bytes(b"GGUF projector")
    assert fetch_model(str(folder)) == folder / "tiny-Q8_0.gguf"
    assert Path(resolve_model(str(folder))) == cached_conversion(tiny_gguf, tmp_path / "cache")
    assert served_name(str(folder), "x") == "Tiny-GGUF"
    (folder / "tiny-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="several GGUF files; name one: tiny-Q4_K_M.gguf, "
                                         "tiny-Q8_0.gguf"):
        resolve_model(str(folder))
    with pytest.raises(ModelError, match="not a model folder"):
        resolve_model(str(tmp_path / "lmstudio"))


def test_an_mlx_folder_is_served_as_it_is(llama_model):
    assert resolve_model(llama_model) == llama_model


def test_a_gguf_file_is_known_by_its_magic_not_its_name(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    bare = tmp_path / "model-blob"
    bare.write_bytes(tiny_gguf.read_bytes())
    assert Path(resolve_model(str(bare))) == cached_conversion(tiny_gguf, tmp_path / "cache")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        resolve_model(str(tmp_path / "fake.gguf"))
    with pytest.raises(ModelError, match="no such file or folder"):
        resolve_model(str(tmp_path / "missing.gguf"))
