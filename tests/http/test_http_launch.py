"""The launcher's HTTP line, --served-model-name, the API key on a real server, and
a fuzz of bodies to every endpoint (the server keeps serving)."""

import os
import random
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from mlxd.launcher import HTTP_PREFIX, READY_PREFIX
from mlxd.model_store.resolve import served_name
from support import ROOT

KEY = "sekret"


def test_served_name_defaults_to_the_folder_or_file_asked_for():
    assert served_name("/models/Qwen3-0.6B", "/models/Qwen3-0.6B") == "Qwen3-0.6B"
    assert served_name("/m/llama.Q4.gguf", "/cache/abc") == "llama.Q4"
    assert served_name("demo", "/cache/demo-model") == "demo-model"
    # the default model: its own name, not its cache folder's
    assert served_name("", "/cache/smollm2-135m-instruct-q4_1-v2") == "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def keyed(llama_model):
    """A server asking for an API key, named `tiny`; its launcher's output lines kept."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "--model", llama_model, "--port", "0",
         "--http-port", "0", "--served-model-name", "tiny", "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True, env={**os.environ, "MLXD_API_KEY": KEY})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(READY_PREFIX):
                break
        yield lines
    finally:
        proc.terminate()
        proc.wait(15)


def _url(lines) -> str:
    return next(line[len(HTTP_PREFIX):] for line in lines if line.startswith(HTTP_PREFIX))


def test_one_http_line_with_the_bound_port_before_ready(keyed):
    http = [i for i, line in enumerate(keyed) if line.startswith(HTTP_PREFIX)]
    assert len(http) == 1 and keyed[-1].startswith(READY_PREFIX) and http[0] < len(keyed) - 1
    url = _url(keyed)
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert httpx.get(url + "/health").status_code == 200   # open without the key


def test_the_api_key_is_required(keyed):
    url = _url(keyed)
    messages = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as good:
        assert [m.id for m in good.models.list()] == ["tiny"]
        assert good.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model="tiny", max_tokens=2, messages=messages)
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as good:
        assert good.messages.create(model="tiny", max_tokens=2, messages=messages).content
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401


ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize",
             "/detokenize", "/admin/models/load"]
VALID = {
    "/v1/chat/completions": b'{"model": "llama", "messages": [{"role": "user", '
                            b'"content": "hi"}], "max_tokens": 3, "stream": true}',
    "/v1/completions": b'{"model": "llama", "prompt": [1, 2, 3], "max_tokens": 3, '
                       b'"logprobs": 2}',
    "/v1/messages": b'{"model": "llama", "max_tokens": 3, "messages": [{"role": "user", '
                    b'"content": "hi"}], "stop_sequences": ["a"]}',
    "/tokenize": b'{"prompt": "hello"}',
    "/detokenize": b'{"tokens": [1, 2, 3]}',
    "/admin/models/load": b'{"model": "llama"}',
}


def _mutations(rng: random.Random, body: bytes) -> list[bytes]:
    cut = body[:rng.randrange(len(body))]
    flipped = bytearray(body)
    for _ in range(3):
        flipped[rng.randrange(len(flipped))] = rng.randrange(256)
    junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    swapped = body.replace(b"3", rng.choice([b'"3"', b"-3", b"3e99", b"null", b"[]", b"{}"]))
    return [cut, bytes(flipped), junk, swapped, b"", b"[]", b'{"model": {}}']


def test_fuzzed_bodies_never_take_the_server_down(llama_server):
    rng = random.Random(0)
    with httpx.Client(base_url=llama_server.http_url, timeout=60) as client:
        for _ in range(8):
            for path in ENDPOINTS:
                for body in _mutations(rng, VALID[path]):
                    r = client.post(path, content=body)
                    assert r.status_code in (200, 400, 404, 413), (path, body, r.text)
                    if r.status_code != 200:
                        assert r.json()   # an error in the API's shape, as JSON
        assert client.get("/health").status_code == 200
        for path, body in VALID.items():
            assert client.post(path, content=body).status_code == 200, path
