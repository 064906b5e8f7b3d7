"""The Responses API takes every number, integer and flag declared in
protocol/sampling.py that an OpenAI body takes, and names it when refused (the 400's
`param`, under the body's name), through a real server: as test_declared_params.py
checks the other endpoints."""

import httpx
import pytest

from test_declared_params import SCALARS, inside, outside

# The parameters the Responses body maps itself (the others it takes under their own
# names, as both OpenAI bodies do): the body field, a valid and a refused value;
# None: this API has no such field (no `n`; logprobs are asked for by `include`).
MAPPED = {"max_tokens": ("max_output_tokens", 2, 2**31),
          "top_logprobs": ("top_logprobs", 1, 21), "n": None, "logprobs": None}


@pytest.fixture(scope="module")
def http(llama_server):
    with httpx.Client(base_url=llama_server.http_url, timeout=60) as client:
        yield client


def test_every_mapped_scalar_is_covered_here():
    assert set(MAPPED) == {p.name for p in SCALARS if not p.openai}


@pytest.mark.parametrize("p", [p for p in SCALARS if p.openai or MAPPED[p.name]],
                         ids=lambda p: p.name)
def test_the_responses_api_takes_each_parameter_and_names_it_when_refused(http, p):
    field, good, bad = MAPPED[p.name] if not p.openai else (p.name, inside(p), outside(p))
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "input": "hi", "max_output_tokens": 2}
    r = http.post("/v1/responses", json={**body, field: good})
    assert r.status_code == 200, (field, good, r.text)
    r = http.post("/v1/responses", json={**body, field: bad})
    assert r.status_code == 400, (field, bad, r.text)
    assert r.json()["error"]["param"] == field, r.json()
