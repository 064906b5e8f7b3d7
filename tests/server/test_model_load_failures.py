"""A model of a --models file whose load fails, on real processes: the requests waiting
for it end at once (far sooner than --model-load-timeout) with a 503 (HTTP) or an
ErrorReply (SDK) naming the model and the cause, `/v1/models` shows it `failed` with
the cause, the other models serve on, and the next request tries the load again
(which succeeds once the folder is mended). Two causes: weights that are not weights
(the worker dies loading them) and a folder gone since the start (the launcher's
resolve refuses it without starting anything)."""

import json
import re
import shutil
import time

import httpx
import pytest

from mlxd import Client, MlxdError
from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import Server

SMALL = TinySpec(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=384, seed=5)
LOAD_TIMEOUT = 120.0   # what a failed load cost a request before it was reported


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "small", SMALL))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, small_model) -> dict:
    root = tmp_path_factory.mktemp("failing")
    broken, gone = root / "broken", root / "gone"
    shutil.copytree(small_model, broken)
    shutil.copytree(small_model, gone)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    return {"broken": broken, "gone": gone, "root": root}


@pytest.fixture(scope="module")
def server(folders, llama_model):
    """llama loaded at start; the budget holds one model, so the others load on demand."""
    entries = [{"name": "llama", "model": llama_model, "memory_gb": 1.0},
               {"name": "broken", "model": str(folders["broken"]), "memory_gb": 1.0},
               {"name": "gone", "model": str(folders["gone"]), "memory_gb": 1.0}]
    path = folders["root"] / "models.json"
    path.write_text(json.dumps(entries))
    server = Server(None, "--models", str(path), "--models-memory", "1",
                    "--model-load-timeout", str(LOAD_TIMEOUT), "--ready-timeout", "120",
                    "--kv-capacity", "2048", "--speculative", "off", "--log-level", "warning")
    yield server
    server.stop()


def complete(server: Server, model: str) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/completions", timeout=LOAD_TIMEOUT + 30, json={
        "model": model, "prompt": "hi", "max_tokens": 2})


def card(server: Server, model: str) -> dict:
    data = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"]
    return next(c for c in data if c["id"] == model)


def failed_at_once(server: Server, model: str) -> str:
    """A request for `model` fails long before the load timeout; its error message."""
    started = time.monotonic()
    r = complete(server, model)
    assert time.monotonic() - started < LOAD_TIMEOUT / 4, r.text
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_load_failed", "model")
    assert f"the model {model!r} failed to load: " in error["message"]
    assert server.proc.poll() is None
    return error["message"]


def test_a_model_whose_worker_cannot_load_fails_at_once_and_is_tried_again(
        server, folders, small_model):
    message = failed_at_once(server, "broken")
    assert re.search(r"its worker\d+ process exited with code 1: .*safetensors", message), \
        message   # the worker's last stderr line: mlx's error naming the file
    failed = card(server, "broken")
    assert failed["state"] == "failed" and failed["failure"] in message
    with Client(server.address, timeout=LOAD_TIMEOUT) as c:   # the SDK's request retries
        with pytest.raises(MlxdError) as caught:
            c.generate("hi", model="broken", max_tokens=2)
    assert caught.value.code == "model_load_failed" and "'broken'" in str(caught.value)
    metrics = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    assert 'mlxd_model_load_failures_total{model="broken"} 2.0' in metrics   # tried again
    assert 'mlxd_model_state{model="broken",state="failed"} 1.0' in metrics
    assert complete(server, "llama").status_code == 200   # the others serve on
    for weights in folders["broken"].glob("*.safetensors"):   # mended: the next one loads
        shutil.copy(f"{small_model}/{weights.name}", weights)
    assert complete(server, "broken").status_code == 200
    mended = card(server, "broken")
    assert mended["state"] == "loaded" and "failure" not in mended


def test_a_model_whose_folder_is_gone_fails_at_once_and_is_tried_again(server, folders,
                                                                       small_model):
    shutil.rmtree(folders["gone"])
    message = failed_at_once(server, "gone")
    assert "no such file or folder" in message, message
    assert card(server, "gone")["state"] == "failed"
    shutil.copytree(small_model, folders["gone"])
    assert complete(server, "gone").status_code == 200
    assert card(server, "gone")["state"] == "loaded"
