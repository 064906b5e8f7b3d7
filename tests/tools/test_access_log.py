"""The HTTP access log (tokenizer_proc/http/access_log.py): a line per request with
method, path, status, latency, model, tokens and a 4xx/5xx's error message; on by
default in a real server, off with --no-access-log."""

import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from mlxd.tokenizer_proc.http.access_log import log as access_log
from mlxd.tokenizer_proc.http.app import build_app
from mlxd.tokenizer_proc.http.context import Api
from mlxd.tokenizer_proc.text import TextCodec
from support import Server, wait_until
from test_http_tools import ScriptedFront

CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def front(tool_model):
    return ScriptedFront(TextCodec(tool_model))


def lines_for(front, caplog, access: bool, *requests) -> list[str]:
    front.reply = "Fine."
    with TestClient(build_app(Api(front, "m"), access_log=access)) as http, \
            caplog.at_level(logging.INFO, logger=access_log.name):
        for method, path, body in requests:
            http.request(method, path, json=body)
    return [r.getMessage() for r in caplog.records if r.name == access_log.name]


def test_a_line_per_request_with_its_model_tokens_and_error(front, caplog):
    lines = lines_for(front, caplog, True,
                      ("POST", "/v1/chat/completions", CHAT),
                      ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
                      ("POST", "/v1/messages", {**CHAT, "top_logprobs": 2}),
                      ("POST", "/v1/chat/completions", {**CHAT, "model": "other"}),
                      ("GET", "/nowhere", None))
    assert len(lines) == 5
    ok, streamed, refused, unknown, missing = lines
    assert ok.startswith("POST /v1/chat/completions 200 ") and "ms model=m " in ok
    assert "prompt_tokens=" in ok and "completion_tokens=" in ok
    assert streamed.startswith("POST /v1/chat/completions 200 ") and "completion_tokens=" \
        in streamed and "error" not in streamed
    assert refused.startswith("POST /v1/messages 400 ") and "top_logprobs: logprobs" in refused
    assert unknown.startswith("POST /v1/chat/completions 404 ") and "model=other" in unknown \
        and "does not exist" in unknown
    assert missing.startswith("GET /nowhere 404 ") and "error=" in missing


def test_no_lines_when_off(front, caplog):
    assert lines_for(front, caplog, False, ("POST", "/v1/chat/completions", CHAT)) == []


@pytest.mark.parametrize("flags, logged", [((), True), (("--no-access-log",), False)])
def test_a_server_logs_its_requests_unless_told_not_to(tool_model, flags, logged):
    server = Server(tool_model, "--kv-capacity", "4096", "--log-level", "info", *flags)
    try:
        with httpx.Client(base_url=server.http_url, timeout=60) as http:
            name = http.get("/v1/models").json()["data"][0]["id"]
            r = http.post("/v1/chat/completions", json={**CHAT, "model": name})
            assert r.status_code == 200
            assert http.post("/v1/chat/completions", json={**CHAT, "model": "x"}) \
                .status_code == 404

        def written() -> list[str]:
            return [line for line in server.stderr_lines if "POST /v1/chat/completions" in line]
        if logged:
            assert wait_until(lambda: len(written()) == 2, 10)
            ok, missing = written()
            assert " 200 " in ok and f"model={name}" in ok and "prompt_tokens=" in ok
            assert " 404 " in missing and "error=" in missing
        else:
            assert server.stop() is not None and written() == []
    finally:
        server.stop()


def test_responses_lines_carry_tokens_and_metrics_name_their_routes(front, caplog):
    """A response's line has its token counts; `/metrics` counts the Responses API's
    routes by their declared path, its id not in the label (bounded)."""
    front.reply = "Fine."
    with TestClient(build_app(Api(front, "m"), access_log=True)) as http, \
            caplog.at_level(logging.INFO, logger=access_log.name):
        made = http.post("/v1/responses", json={"model": "m", "input": "hi", "store": True})
        assert made.status_code == 200
        rid = made.json()["id"]
        assert http.get(f"/v1/responses/{rid}").status_code == 200
        assert http.get("/v1/responses/resp_missing").status_code == 404
        assert http.post(f"/v1/responses/{rid}/cancel").status_code in (200, 400)
        assert http.get("/v1/models/m").status_code == 200
        assert http.get("/nowhere").status_code == 404
        text = http.get("/metrics").text
    [line] = [r.getMessage() for r in caplog.records
              if r.name == access_log.name and r.getMessage().startswith("POST /v1/responses ")]
    assert "prompt_tokens=" in line and "completion_tokens=" in line
    counted = 'mlxd_http_requests_total{endpoint="%s",status="%s"} 1.0'
    assert counted % ("/v1/responses/{response_id}", 200) in text
    assert counted % ("/v1/responses/{response_id}", 404) in text
    assert 'endpoint="/v1/responses/{response_id}/cancel"' in text
    assert counted % ("/v1/models/{model}", 200) in text
    assert counted % ("other", 404) in text
    assert rid not in text
