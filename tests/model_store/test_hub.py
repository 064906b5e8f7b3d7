"""Hugging Face ids through a Hugging Face cache laid out by the tests and resolved by
the real huggingface_hub; the Hub itself is a closed loopback port (no network)."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from mlxd.model_store.gguf import cached_conversion
from mlxd.model_store.hub import (HubError, HubId, parse_hub_id, pick_gguf, quant_matches,
                                  resolve_hub)
from mlxd.model_store.resolve import ModelError, resolve_model, served_name
from support import PROMPTS, ROOT, Server, encode, reference_tokens
from test_ollama import pull as ollama_pull

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
GGUF_NAMES = ["Tiny-Q4_K_M.gguf", "Tiny-Q4_K_S.gguf", "Tiny-IQ4_XS.gguf", "Tiny-Q8_0.gguf",
              "tiny.Q4_K.gguf", "Tiny-BF16.gguf"]


def cache_repo(hub_cache: Path, repo: str, files: dict, ref: str = "main",
               commit: str | None = None) -> Path:
    """Lay out `files` (name -> bytes or a file) as huggingface_hub caches one revision
    of a repository: content-named blobs, the snapshot's relative links to them, and the
    ref naming the commit. The snapshot folder."""
    root = hub_cache / f"models--{repo.replace('/', '--')}"
    commit = commit or hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot


def model_files(folder: str) -> dict:
    return {name: Path(folder) / name for name in MODEL_FILES}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_env(home: Path, **extra) -> dict:
    """The environment of a process whose Hugging Face cache is `home`/hub and whose
    Hub is a closed loopback port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
            "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


class FakeHub:
    """A loopback stand-in for the Hub's few routes huggingface_hub downloads with:
    repository info, its file tree, and files (HEAD, GET); one commit per repository,
    whose revisions are `main` and the commit."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos, self.requests = repos, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def answer(self, handler, body: bool) -> None:
        parts = unquote(urlparse(handler.path).path).strip("/").split("/")
        self.requests.append((handler.command, "/".join(parts)))
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[:2])
        files = self.repos.get(repo)
        if files is None:
            return self.send(handler, 404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
        revision = (parts[5] if len(parts) > 5 else "main") if api else parts[3]
        if revision not in ("main", self.commit(repo)):
            return self.send(handler, 404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body)
        if api:
            listing = ([{"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()]
                       if parts[4] == "tree" else
                       {"id": repo, "sha": self.commit(repo),
                        "siblings": [{"rfilename": name} for name in files]})
            return self.send(handler, 200, json.dumps(listing).encode(),
                             {"Content-Type": "application/json"}, body)
        data = files.get("/".join(parts[4:]))   # ORG/NAME/resolve/REVISION/FILE
        if data is None:
            return self.send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        self.send(handler, 200, data, {"X-Repo-Commit": self.commit(repo),
                                       "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)

    @staticmethod
    def send(handler, code: int, data: bytes, headers: dict, body: bool) -> None:
        handler.send_response(code)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


def mlxd(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxd.launcher", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_ids_are_org_name_with_a_revision_and_a_quantization():
    assert parse_hub_id("mlx-community/Qwen3-8B-4bit") == HubId("mlx-community/Qwen3-8B-4bit")
    assert parse_hub_id("org/m@v1.0") == HubId("org/m", "v1.0")
    assert parse_hub_id("org/m-GGUF:q4_k_m") == HubId("org/m-GGUF", "main", "q4_k_m")
    assert parse_hub_id("org/m@refs/pr/3:Q8_0") == HubId("org/m", "refs/pr/3", "Q8_0")
    for not_an_id in ("model", "/abs/path", "./org/m", "a/b/c", "org/", "org--x/m", "org/m@",
                      "org/a..b", "ollama:qwen3"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_a_quantization_name_picks_one_gguf_file():
    assert pick_gguf(GGUF_NAMES, "Q4_K_M", "r") == "Tiny-Q4_K_M.gguf"
    assert pick_gguf(GGUF_NAMES, "q4_k_m", "r") == "Tiny-Q4_K_M.gguf"   # any case
    assert pick_gguf(GGUF_NAMES, "Q4_K", "r") == "tiny.Q4_K.gguf"       # not Q4_K_M / Q4_K_S
    assert pick_gguf(GGUF_NAMES, "IQ4_XS", "r") == "Tiny-IQ4_XS.gguf"
    assert quant_matches(GGUF_NAMES, "Q4_XS") == [] and quant_matches(GGUF_NAMES, "F16") == []
    assert pick_gguf(["sub/m-Q8_0.gguf", "README.md"], "q8_0", "r") == "sub/m-Q8_0.gguf"
    # no tag: Q4_K_M if there, else the only model file (a projector is not one)
    assert pick_gguf(GGUF_NAMES, None, "r") == "Tiny-Q4_K_M.gguf"
    assert pick_gguf(["a-Q8_0.gguf", "mmproj-f16.gguf"], None, "r") == "a-Q8_0.gguf"
    with pytest.raises(HubError, match=r"org/r has no GGUF file for 'Q2_K' \(its GGUF files: "
                                       r"Tiny-BF16.gguf, "):
        pick_gguf(GGUF_NAMES, "Q2_K", "org/r")
    with pytest.raises(HubError, match="several GGUF files and none is Q4_K_M; name one with "
                                       r":QUANT \(a-Q8_0.gguf, b-F16.gguf\)"):
        pick_gguf(["a-Q8_0.gguf", "b-F16.gguf"], None, "org/r")
    with pytest.raises(HubError, match="split into several files"):
        pick_gguf(["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"], None, "r")


def test_a_cached_model_resolves_offline_at_its_revision(llama_model, qwen3_model, tmp_path):
    """main, a tag and a commit, each its own snapshot; nothing asked of the Hub (whose
    address here is unreachable anyway)."""
    cache = tmp_path / "hub"
    main = cache_repo(cache, "org/tiny", model_files(llama_model))
    tagged = cache_repo(cache, "org/tiny", model_files(qwen3_model), ref="v1")
    assert resolve_hub("org/tiny", str(cache)) == main
    assert resolve_hub("org/tiny@main", str(cache)) == main
    assert resolve_hub("org/tiny@v1", str(cache)) == tagged
    assert resolve_hub(f"org/tiny@{tagged.name}", str(cache)) == tagged
    assert json.loads((resolve_hub("org/tiny@v1", str(cache)) / "config.json").read_text())[
        "model_type"] == "qwen3"


def test_a_quantization_tag_picks_a_cached_gguf_file(tmp_path):
    cache = tmp_path / "hub"
    snapshot = cache_repo(cache, "org/Tiny-GGUF",
                          {name: b"GGUF " + name.encode() for name in GGUF_NAMES} |
                          {"README.md": b"# tiny"})
    assert resolve_hub("org/Tiny-GGUF:Q8_0", str(cache)) == snapshot / "Tiny-Q8_0.gguf"
    assert resolve_hub("org/Tiny-GGUF:iq4_xs", str(cache)) == snapshot / "Tiny-IQ4_XS.gguf"
    assert resolve_hub("org/Tiny-GGUF", str(cache)) == snapshot / "Tiny-Q4_K_M.gguf"


def test_a_hub_gguf_goes_through_the_gguf_conversion(llama_model, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from test_gguf import write_model_gguf

    write_model_gguf(Path(llama_model), tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    cache = tmp_path / "hub"
    cache_repo(cache, "org/Tiny-GGUF", {"tiny-Q8_0.gguf": tmp_path / "tiny-Q8_0.gguf",
                                        "tiny-F16.gguf": b"GGUF not this one"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))   # read at import
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "mlxd"))
    folder = resolve_model("org/Tiny-GGUF:Q8_0")
    assert Path(folder) == cached_conversion(tmp_path / "tiny-Q8_0.gguf", tmp_path / "mlxd")
    assert served_name("org/Tiny-GGUF:Q8_0", folder) == "org/Tiny-GGUF:Q8_0"


def test_pull_serves_the_cache_of_hf_home_or_hf_hub_cache(llama_model, tmp_path):
    """`mlxd pull` in a process of its own: the variables as huggingface_hub reads them,
    the Hub unreachable, so the path printed is the cache's."""
    snapshot = cache_repo(tmp_path / "home" / "hub", "org/tiny", model_files(llama_model))
    done = mlxd("pull", "org/tiny", env=hub_env(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)
    elsewhere = cache_repo(tmp_path / "elsewhere", "org/tiny", model_files(llama_model))
    done = mlxd("pull", "org/tiny", env=hub_env(tmp_path / "unused",
                                                HF_HUB_CACHE=str(tmp_path / "elsewhere")))
    assert done.stdout.strip() == str(elsewhere), done.stderr


def test_what_is_not_cached_is_downloaded_then_served_offline(llama_model, tmp_path):
    """Only the files mlx_lm reads (no README, no PyTorch weights); of a GGUF
    repository only the file the tag picks; afterwards the cache serves them with the
    Hub gone."""
    files = {name: (Path(llama_model) / name).read_bytes() for name in MODEL_FILES}
    hub = FakeHub({"org/tiny": {**files, "README.md": b"# tiny", "pytorch_model.bin": b"x"},
                   "org/Tiny-GGUF": {name: b"GGUF " + name.encode() for name in GGUF_NAMES}})
    env = hub_env(tmp_path / "home", HF_ENDPOINT=hub.url)
    try:
        done = mlxd("pull", "org/tiny", env=env)
        assert done.returncode == 0, done.stderr
        folder = Path(done.stdout.strip())
        assert sorted(p.name for p in folder.iterdir()) == sorted(MODEL_FILES)
        assert "downloading org/tiny into the Hugging Face cache" in done.stderr
        picked = {}
        for tag in ("Q8_0", "q4_k", ""):
            done = mlxd("pull", f"org/Tiny-GGUF{tag and ':' + tag}", env=env)
            assert done.returncode == 0, done.stderr
            picked[tag] = Path(done.stdout.strip())
        assert {tag: path.name for tag, path in picked.items()} == {
            "Q8_0": "Tiny-Q8_0.gguf", "q4_k": "tiny.Q4_K.gguf", "": "Tiny-Q4_K_M.gguf"}
        assert sorted(p.name for p in picked[""].parent.iterdir()) == sorted(
            p.name for p in picked.values())
        done = mlxd("pull", "org/tiny@v9", env=env)
        assert done.returncode == 1 and "org/tiny has no revision 'v9'" in done.stderr
        done = mlxd("pull", "org/none", env=env)
        assert done.returncode == 1 and "the Hub has no such model" in done.stderr
    finally:
        hub.close()
    assert not any(path.endswith(("README.md", ".bin")) for _, path in hub.requests)
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    for spec, path in [("org/tiny", folder), ("org/Tiny-GGUF:q8_0", picked["Q8_0"])]:
        done = mlxd("pull", spec, env=offline)
        assert done.stdout.strip() == str(path), done.stderr


@pytest.mark.parametrize("offline", ["0", "1"])
def test_an_unknown_id_is_a_clear_error_at_once(offline, tmp_path):
    """Neither cached nor reachable: the id named, with no retry loop (huggingface_hub
    retries some requests for ~25 s); the same through `mlxd pull` and `--model`."""
    env = hub_env(tmp_path / "home", HF_HUB_OFFLINE=offline)
    timed = ("import sys, time\nimport mlx_lm.utils\nfrom mlxd.model_store.hub import "
             "HubError, resolve_hub\nstart = time.monotonic()\ntry:\n    resolve_hub('org/nope')"
             "\nexcept HubError as exc:\n    print(f'{time.monotonic() - start:.2f}', exc)")
    done = subprocess.run([sys.executable, "-c", timed], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    seconds, message = done.stdout.split(" ", 1)
    assert float(seconds) < 3, done.stdout
    assert "org/nope is not in the Hugging Face cache" in message
    assert str(tmp_path / "home" / "hub") in message
    assert ("HF_HUB_OFFLINE is set" if offline == "1" else "could not be reached") in message
    done = mlxd("pull", "org/nope", env=env)
    assert done.returncode == 1 and "org/nope is not in the Hugging Face cache" in done.stderr
    done = mlxd("--model", "org/nope", env=env)
    assert done.returncode == 1 and "org/nope is not in the Hugging Face cache" in done.stderr


def test_models_lists_the_caches(llama_model, tmp_path):
    import mlx.core as mx

    home, own = tmp_path / "home", tmp_path / "mlxd"
    cache_repo(home / "hub", "org/tiny", model_files(llama_model))
    weights = tmp_path / "mlx.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.zeros((4, 4))}, metadata={"format": "mlx"})
    cache_repo(home / "hub", "mlx-community/Tiny-4bit",
               {"config.json": b"{}", "model.safetensors": weights})
    cache_repo(home / "hub", "org/Tiny-GGUF", {"a-Q8_0.gguf": b"GGUF" * 1000})
    converted = own / "gguf" / "0123abcd-v2"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text(json.dumps({"gguf": {}}))
    ollama_pull(tmp_path / "ollama", "tiny", "latest", b"GGUF ollama")
    done = mlxd("models", env=hub_env(home, MLXD_CACHE_DIR=str(own),
                                      OLLAMA_MODELS=str(tmp_path / "ollama")))
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert rows[0] == ["NAME", "FORMAT", "SIZE"]
    assert [row[:2] for row in rows[1:]] == [
        ["mlx-community/Tiny-4bit", "mlx"], ["org/tiny", "safetensors"],
        ["org/Tiny-GGUF", "gguf"], ["ollama:tiny:latest", "gguf"],
        [str(converted), "converted-gguf"]]
    size = sum((Path(llama_model) / name).stat().st_size for name in MODEL_FILES)
    assert rows[2][2:] == [f"{size / 1e6:.1f}", "MB"]


def test_the_server_serves_a_cached_hub_id_offline_like_mlx_lm(llama_model, tmp_path):
    """`mlxd --model org/tiny` with HF_HUB_OFFLINE: mlx_lm's tokens and logprobs, and
    the HTTP API names the model by its id."""
    cache_repo(tmp_path / "home" / "hub", "org/tiny", model_files(llama_model))
    env = hub_env(tmp_path / "home", HF_HUB_OFFLINE="1")
    server = Server("org/tiny", "--kv-capacity", "4096", "--log-level", "warning", env=env)
    try:
        from mlxd.client import Client

        with Client(server.address, timeout=60) as c:
            for prompt in PROMPTS[:3]:
                ids = encode(llama_model, prompt)
                result = c.generate(input_ids=ids, max_tokens=12, logprobs=True)
                ref = reference_tokens(llama_model, ids, 12)
                assert result.token_ids == [t for t, _ in ref]
                assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3
        with urllib.request.urlopen(f"{server.http_url}/v1/models", timeout=30) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == ["org/tiny"]
    finally:
        server.stop()
