"""Every parameter declared in protocol/sampling.py, generated from the declarations:
the core knows it and refuses a value out of its bounds by name; the OpenAI bodies have
a field for each parameter sent on as is, the Anthropic body one for each it takes; and
through a real server, each number, integer and flag is accepted by both OpenAI
endpoints, the Messages API where it takes it and the SDK, and refused out of bounds
with its name (over HTTP, the 400's `param`, under the body's name)."""

import math

import httpx
import pytest

from mlxd import Client, MlxdError
from mlxd.protocol import PARAMS, Param
from mlxd.tokenizer_proc.http.anthropic_schema import MessagesRequest
from mlxd.tokenizer_proc.http.anthropic_schema import PASSED as ANTHROPIC
from mlxd.tokenizer_proc.http.openai_schema import ChatRequest, CompletionRequest
from mlxd.tokenizer_proc.params import KNOWN, InvalidRequest, parse_params

SCALARS = [p for p in PARAMS.values() if p.scalar]


def inside(p: Param):
    """A value the declaration accepts, other than the default where it can."""
    if p.kind == "flag":
        return not p.default
    if p.kind == "integer":
        start = p.lo if p.default is None else max(p.lo, p.default)
        return int(min(p.hi, start + 1))
    if math.isfinite(p.lo) and math.isfinite(p.hi):
        return p.lo + (p.hi - p.lo) / 4
    return (p.default or 0.0) + 0.5


def outside(p: Param):
    """A value the declaration refuses: past a bound, or, for a flag, not a bool."""
    if p.kind == "flag":
        return "yes"
    step = 1 if p.kind == "integer" else 1.0
    return p.hi + step if math.isfinite(p.hi) else p.lo - step


# What a request needs besides the parameter for the value to be valid (core names).
NEEDS = {"top_logprobs": {"logprobs": True}}
# The parameters the OpenAI routes map themselves (declared `openai=False`): per
# endpoint, the body field, a valid and a refused value, and the fields it needs.
MAPPED = {
    "max_tokens": {"chat": ("max_completion_tokens", 2, 2**31, {}),
                   "completions": ("max_tokens", 2, 2**31, {})},
    "n": {"chat": ("n", 2, 17, {}), "completions": ("n", 2, 17, {})},
    "top_logprobs": {"chat": ("top_logprobs", 1, 21, {"logprobs": True}),
                     "completions": ("logprobs", 1, 21, {})},
    "logprobs": {"chat": ("logprobs", True, "yes", {}),
                 "completions": ("logprobs", 0, "yes", {})},
}


def openai_cases(p: Param, api: str) -> tuple[str, object, object, dict]:
    if not p.openai:
        return MAPPED[p.name][api]
    return p.name, inside(p), outside(p), NEEDS.get(p.name, {})


# ---- the declarations and what derives from them (no server) -------------------------

def test_every_declared_parameter_is_known_and_nothing_else():
    assert KNOWN == set(PARAMS)


def test_every_mapped_scalar_is_covered_here():
    """A parameter a route maps by hand must be added to MAPPED to be tested."""
    assert set(MAPPED) == {p.name for p in SCALARS if not p.openai}


def test_the_bodies_have_a_field_for_every_parameter_sent_on_as_is():
    for p in PARAMS.values():
        if p.openai:
            assert p.name in ChatRequest.model_fields, p.name
            assert p.name in CompletionRequest.model_fields, p.name
        if p.anthropic:
            assert p.anthropic in MessagesRequest.model_fields, p.name
    assert set(ANTHROPIC.values()) == {p.name for p in PARAMS.values() if p.anthropic}


@pytest.mark.parametrize("p", SCALARS, ids=lambda p: p.name)
def test_the_core_takes_a_value_inside_and_names_one_outside(p):
    needs = {**NEEDS.get(p.name, {}), **({"max_tokens": 2} if p.name != "max_tokens" else {})}
    got = parse_params({p.name: inside(p), **needs}, 512, 16)
    assert got is not None
    with pytest.raises(InvalidRequest) as info:
        parse_params({p.name: outside(p), **needs}, 512, 16)
    assert info.value.param == p.name and p.name in str(info.value)


def test_a_bias_out_of_bounds_names_logit_bias():
    with pytest.raises(InvalidRequest) as info:
        parse_params({"logit_bias": {"3": 101}}, 512, 16)
    assert info.value.param == "logit_bias" and "logit_bias[3]" in str(info.value)


# ---- through a real server ---------------------------------------------------------

@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server):
    with Client(server.address, timeout=60) as client:
        yield client


def _model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _bodies(http, api: str) -> tuple[str, dict]:
    model = _model(http)
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]}
    if api == "completions":
        return "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 2}
    return "/v1/messages", {"model": model, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("p", SCALARS, ids=lambda p: p.name)
def test_openai_endpoints_take_each_parameter_and_name_it_when_refused(http, api, p):
    path, body = _bodies(http, api)
    field, good, bad, needs = openai_cases(p, api)
    body = {**body, **needs}
    r = http.post(path, json={**body, field: good})
    assert r.status_code == 200, (field, good, r.text)
    r = http.post(path, json={**body, field: bad})
    assert r.status_code == 400, (field, bad, r.text)
    assert r.json()["error"]["param"] == field, r.json()


@pytest.mark.parametrize("p", [p for p in SCALARS if p.anthropic], ids=lambda p: p.name)
def test_the_messages_api_takes_each_parameter_it_declares(http, p):
    path, body = _bodies(http, "messages")
    r = http.post(path, json={**body, p.anthropic: inside(p)})
    assert r.status_code == 200, (p.anthropic, r.text)
    r = http.post(path, json={**body, p.anthropic: outside(p)})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert p.anthropic in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("p", SCALARS, ids=lambda p: p.name)
def test_the_sdk_takes_each_parameter_and_names_it_when_refused(sdk, p):
    params = {"max_tokens": 2, **NEEDS.get(p.name, {})}
    result = sdk.generate("Hello", **{**params, p.name: inside(p)})
    assert result is not None
    with pytest.raises(MlxdError) as info:
        sdk.generate("Hello", **{**params, p.name: outside(p)})
    assert info.value.code == "invalid_request" and info.value.param == p.name
