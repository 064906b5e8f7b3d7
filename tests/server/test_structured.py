"""response_format through the real server: constrained requests share the batch
with unconstrained ones, on a random-weight model whose only way to valid output is
the constraint."""

import asyncio
import json

import pytest

from mlxd.client import AsyncClient, Client, MlxdError
from structured_support import response_formats, satisfies
from support import PROMPTS

# (constrained, unconstrained) requests per kind, sent at once
COUNTS = {"json_schema": 50, "regex": 20, "grammar": 20}
FREE_TOKENS = 16          # each unconstrained request's max_tokens
CONSTRAINED_TOKENS = 200  # far more than any constrained output needs


async def _mixed(address: str, kind: str, n: int):
    rf = response_formats()[kind]
    async with AsyncClient(address, timeout=120) as c:
        constrained = [c.generate(PROMPTS[i % 8], response_format=rf, temperature=1.0,
                                  seed=i, max_tokens=CONSTRAINED_TOKENS) for i in range(n)]
        free = [c.generate(PROMPTS[i % 8], temperature=1.0, seed=1000 + i,
                           max_tokens=FREE_TOKENS) for i in range(n)]
        results = await asyncio.gather(*constrained, *free)
    return results[:n], results[n:]


async def _solo(address: str, n: int):
    async with AsyncClient(address, timeout=120) as c:
        return [await c.generate(PROMPTS[i % 8], temperature=1.0, seed=1000 + i,
                                 max_tokens=FREE_TOKENS) for i in range(n)]


@pytest.mark.parametrize("kind", list(COUNTS))
def test_constrained_outputs_are_valid_and_their_neighbours_unchanged(llama_server, kind):
    n = COUNTS[kind]
    constrained, free = asyncio.run(_mixed(llama_server.address, kind, n))
    for r in constrained:
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        assert satisfies(kind, r.text), r.text
    assert len({r.text for r in constrained}) > 1   # sampled, not one forced string
    solo = asyncio.run(_solo(llama_server.address, n))
    assert [r.token_ids for r in free] == [r.token_ids for r in solo]


def test_without_the_constraint_the_model_writes_no_json(llama_server):
    """The model alone does not produce what the constraint guarantees."""
    with Client(llama_server.address, timeout=60) as c:
        texts = [c.generate(PROMPTS[i], temperature=1.0, seed=i, max_tokens=40).text
                 for i in range(8)]
    assert not any(satisfies("json_schema", t) for t in texts)


def test_max_tokens_mid_structure_ends_with_length(llama_server):
    with Client(llama_server.address, timeout=60) as c:
        r = c.generate(PROMPTS[0], response_format=response_formats()["json_schema"],
                       temperature=1.0, seed=3, max_tokens=6)
    assert r.finish_reason == "length" and len(r.token_ids) == 6
    assert r.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(r.text)


def test_every_choice_follows_the_constraint(llama_server):
    with Client(llama_server.address, timeout=60) as c:
        results = c.generate(PROMPTS[1], response_format=response_formats()["json_schema"],
                             n=4, temperature=1.0, seed=9, max_tokens=CONSTRAINED_TOKENS)
    assert [r.index for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r.finish_reason == "stop" and satisfies("json_schema", r.text), r.text


def test_json_object_starts_an_object(llama_server):
    """Any object: a random model's keys may run on, so only the start is certain."""
    with Client(llama_server.address, timeout=60) as c:
        r = c.generate(PROMPTS[2], response_format={"type": "json_object"}, max_tokens=8)
    assert r.text.startswith("{") and r.finish_reason in ("stop", "length")


@pytest.mark.parametrize("rf, problem", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
     "does not compile"),
    ({"type": "grammar", "grammar": "start: missing"}, "does not compile"),
    ({"type": "yaml"}, "type is one of"),
])
def test_a_bad_constraint_is_an_invalid_request(llama_server, rf, problem):
    with Client(llama_server.address, timeout=60) as c:
        with pytest.raises(MlxdError) as exc:
            c.generate(PROMPTS[0], response_format=rf, max_tokens=4)
        assert c.generate(PROMPTS[0], max_tokens=2).finish_reason   # the server serves on
    assert exc.value.code == "invalid_request"
    assert "response_format" in exc.value.message and problem in exc.value.message
