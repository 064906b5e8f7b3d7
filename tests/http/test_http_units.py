"""The HTTP layer without a model: error shapes and parameter naming, choices grouped
by request and index, usage, logprob forms, API key, not-ready answers."""

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from mlxd.protocol import ErrorReply, StreamChunk
from mlxd.tokenizer_proc.http.app import build_app
from mlxd.tokenizer_proc.http.choices import Outputs, chat_logprobs, completion_logprobs
from mlxd.tokenizer_proc.http.context import Api
from mlxd.tokenizer_proc.http.errors import anthropic_body, openai_body, validation_error
from mlxd.tokenizer_proc.http.openai_api import prompt_inputs
from mlxd.tokenizer_proc.http.openai_schema import ChatRequest, CompletionRequest
from mlxd.tokenizer_proc.http.requests import core_error, core_params


def test_a_wrong_type_is_a_400_naming_the_field():
    with pytest.raises(ValidationError) as exc:
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": 3}]})
    err = validation_error(exc.value)
    assert err.status == 400 and err.param == "messages.0.content"
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": "1"})
    assert validation_error(exc.value).param == "temperature"


def test_an_unsupported_parameter_is_named():
    with pytest.raises(ValidationError) as exc:
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                    "frobnicate": [{"name": "f"}]})
    err = validation_error(exc.value)
    assert err.param == "frobnicate" and "does not support" in err.message


def test_core_errors_name_their_parameter_under_the_bodys_name():
    err = core_error(ErrorReply("0", "invalid_request", "top_logprobs must be in [0, 20]",
                                "top_logprobs"), {"top_logprobs": "logprobs"})
    assert (err.status, err.param) == (400, "logprobs")
    err = core_error(ErrorReply("0", "invalid_request", "unknown parameter(s) ['n']; known: "
                                "['max_tokens']", "n"), {})
    assert err.param == "n"
    err = core_error(ErrorReply("0", "invalid_request", "the prompt has 9 tokens; the "
                                "model's context is 8 tokens", "prompt"), {"prompt": "messages"})
    assert err.param == "messages" and "context is 8" in err.message
    assert core_error(ErrorReply("0", "invalid_request", "the prompt is empty"), {}).param is None
    assert core_error(ErrorReply("0", "internal_error", "boom"), {}).status == 500


def test_params_pass_through_under_openai_names():
    body = CompletionRequest.model_validate({
        "model": "m", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": 0.1,
        "repetition_penalty": 1.1, "min_tokens": 2, "n": 2, "logit_bias": {"7": -100},
        "skip_special_tokens": False})
    params = core_params(body, 9)
    assert params == {"presence_penalty": 0.5, "frequency_penalty": 0.1,
                      "repetition_penalty": 1.1, "min_tokens": 2, "n": 2,
                      "skip_special_tokens": False,
                      "logit_bias": {7: -100.0}, "max_tokens": 9}


@pytest.mark.parametrize("prompt, inputs", [
    ("a", [{"prompt": "a"}]),
    (["a", "b"], [{"prompt": "a"}, {"prompt": "b"}]),
    ([1, 2], [{"input_ids": [1, 2]}]),
    ([[1], [2, 3]], [{"input_ids": [1]}, {"input_ids": [2, 3]}]),
])
def test_prompt_forms(prompt, inputs):
    body = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert prompt_inputs(body.prompt) == inputs


def test_choices_are_grouped_by_request_and_index():
    """A call's requests in their order, whatever their rids (no number parsed)."""
    out = Outputs(["r-first", "r-second"], n=2, echo=["P0", "P1"])
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "cached_tokens": 2}
    for rid, index, text in [("r-second", 1, "b"), ("r-first", 0, "a"), ("r-second", 0, "c")]:
        out.add(StreamChunk(rid, text, [5], finish_reason="stop", usage=usage, index=index))
    assert [(c.index, c.text) for c in out.in_order()] == [(0, "P0a"), (2, "P1c"), (3, "P1b")]
    assert out.usage() == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11,
                           "prompt_tokens_details": {"cached_tokens": 4}}


def test_logprob_forms():
    text = {1: "a", 2: "bc", 3: "é"}.get
    chat = chat_logprobs(text, [1, 3], [-0.5, -1.0], [[[1, 2], [-0.5, -2.0]], None])
    assert chat["content"][0]["top_logprobs"][1] == {"token": "bc", "logprob": -2.0,
                                                     "bytes": [98, 99]}
    assert chat["content"][1]["bytes"] == list("é".encode()) and \
        chat["content"][1]["top_logprobs"] == []
    legacy = completion_logprobs(text, [2, 1], [-0.1, -0.2], [[[2], [-0.1]], None], 3)
    assert legacy == {"tokens": ["bc", "a"], "token_logprobs": [-0.1, -0.2],
                      "top_logprobs": [{"bc": -0.1}, None], "text_offset": [3, 5]}


def test_error_shapes():
    from mlxd.tokenizer_proc.http.errors import ApiError

    err = ApiError(401, "no key")
    assert openai_body(err) == {"error": {"message": "no key", "type": "authentication_error",
                                          "param": None, "code": None}}
    assert anthropic_body(err) == {"type": "error", "error": {
        "type": "authentication_error", "message": "no key"}}


class _NotReadyFront:
    """A tokenizer whose scheduler has not reported its limits yet."""

    @staticmethod
    def _submit(client, req, sink):
        raise AssertionError("nothing may be submitted before the server is ready")

    core = SimpleNamespace(limits=None, codec=None, submit=_submit)
    engines_up = 0

    async def send(self, to_scheduler=()):
        pass


@pytest.fixture
def http():
    with TestClient(build_app(Api(_NotReadyFront(), "m", api_key="k"))) as client:
        yield client


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_the_api_key_is_asked_everywhere_but_health_and_metrics(http):
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", {}),
                       ("/tokenize", {}), ("/detokenize", {})]:
        r = http.post(path, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.get("/v1/models").status_code == 401
    r = http.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert http.get("/health").status_code == 503
    assert http.get("/metrics").status_code == 200


def test_not_ready_is_503_in_each_shape(http):
    r = http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    r = http.post("/v1/messages", headers={"x-api-key": "k"}, json={
        "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("body", [b"{", b"[]", b"\xff", b'{"model": "m", "messages": []}',
                                  b"null", json.dumps({"model": 3}).encode()])
def test_bad_bodies_are_400_not_422(http, body):
    r = http.post("/v1/chat/completions", content=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_too_large_is_refused_while_it_is_read(http, monkeypatch):
    from mlxd.tokenizer_proc.http import context

    monkeypatch.setattr(context, "MAX_BODY_BYTES", 100)
    auth = {"Authorization": "Bearer k"}
    r = http.post("/v1/completions", content=b"x" * 101, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = http.post("/v1/completions", content=iter([b"x" * 60, b"x" * 60]), headers=auth)
    assert r.status_code == 413   # no length declared: counted as it comes


def test_uvicorn_serves_with_its_c_http_parser():
    """httptools is a dependency so that uvicorn's "auto" picks its C parser, not the
    pure-Python h11 fallback (CPU on every streamed chunk)."""
    import uvicorn

    config = uvicorn.Config(build_app(SimpleNamespace()), log_config=None)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
