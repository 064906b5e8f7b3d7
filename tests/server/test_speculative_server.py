"""Speculative decoding through the real server and the clients users run: the same
tokens with drafts as without (greedy, seeded), the accepted count in the SDK's usage,
the counters in stats and /metrics."""

import asyncio
import random
import urllib.request

import openai
import pytest

from mlxd.client import AsyncClient
from support import Server, reference_tokens

MAX_TOKENS = 60


def repetitive_ids(seed: int, block: int = 12, times: int = 4) -> list[int]:
    """A prompt that repeats itself: n-gram drafts find their continuation in it."""
    rng = random.Random(seed)
    unit = [rng.randrange(10, 500) for _ in range(block)]
    return unit * times + unit[:3]


REQUESTS = [({}, repetitive_ids(1)), ({}, repetitive_ids(2, block=7)),
            ({"temperature": 1.0, "seed": 11}, repetitive_ids(3)),
            ({"temperature": 0.8, "top_p": 0.9, "seed": 5, "presence_penalty": 0.5},
             repetitive_ids(4, block=9)),
            ({}, [random.Random(9).randrange(10, 500) for _ in range(40)])]


def run_all(server: Server) -> tuple[list, dict]:
    async def go():
        async with AsyncClient(server.address, timeout=300) as c:
            results = await asyncio.gather(*(
                c.generate(input_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True,
                           **params) for params, ids in REQUESTS))
            return results, await c.stats()
    return asyncio.run(go())


def test_drafts_change_no_token_and_are_counted(llama_model):
    # every proposal goes out (drafts sized by the measured cost may, on a loaded
    # machine, not go out at all; that path is the next test's)
    on = Server(llama_model, "--speculative", "ngram", "--spec-cost", "none",
                "--log-level", "warning")
    try:
        with_drafts, stats = run_all(on)
        with urllib.request.urlopen(on.http_url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    finally:
        on.stop()
    off = Server(llama_model, "--speculative", "off", "--log-level", "warning")
    try:
        without, off_stats = run_all(off)
    finally:
        off.stop()
    spec = stats["speculative"]
    assert spec["method"] == "ngram" and spec["verifies"] > 0
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert off_stats["speculative"] == {"method": "off", "verifies": 0, "draft_tokens": 0,
                                        "accepted_tokens": 0}
    for a, b in zip(with_drafts, without):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        assert a.usage["completion_tokens"] == b.usage["completion_tokens"] == MAX_TOKENS
        assert b.usage["accepted_tokens"] == 0
    greedy_ids = REQUESTS[0][1]
    want = [t for t, _ in reference_tokens(llama_model, greedy_ids, MAX_TOKENS, ignore_eos=True)]
    assert with_drafts[0].token_ids == want
    assert sum(r.usage["accepted_tokens"] for r in with_drafts) == spec["accepted_tokens"]
    counted = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("mlxd_spec_") and 'method="ngram"' in line}
    assert counted["mlxd_spec_accepted_tokens_total"] == spec["accepted_tokens"]
    assert counted["mlxd_spec_verifies_total"] == spec["verifies"]
    assert stats["used_slots"] == 0


def test_openai_client_text_and_stop_strings_are_the_same_with_drafts(llama_model):
    """Through the OpenAI client, streamed and not: the text, a stop string's cut
    (which may fall inside a verified run) and the usage it counts, with drafts as
    without."""
    def ask(server, stop):
        c = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)
        text = "".join(chunk.choices[0].text for chunk in c.completions.create(
            model=c.models.list().data[0].id, prompt="one two three " * 8, max_tokens=48,
            temperature=0, stream=True, stop=stop) if chunk.choices)
        whole = c.completions.create(model=c.models.list().data[0].id,
                                     prompt="one two three " * 8, max_tokens=48,
                                     temperature=0, stop=stop)
        return text, whole.choices[0].text, whole.usage.completion_tokens

    outputs = {}
    for mode in ("ngram", "off"):   # ngram as by default: drafts sized by the measured cost
        server = Server(llama_model, "--speculative", mode, "--log-level", "warning")
        try:
            free = ask(server, None)[1]
            stop = free[len(free) // 2:len(free) // 2 + 3] if len(free) > 8 else None
            outputs[mode] = (free, ask(server, [stop] if stop else None))
        finally:
            server.stop()
    assert outputs["ngram"] == outputs["off"]


def test_structured_output_and_forced_calls_are_the_same_with_drafts(llama_model):
    """Constrained requests draft too (each draft position masked by the grammar):
    through the OpenAI client, a json_schema reply and a forced tool call, greedy
    and seeded, are what they are with speculation off."""
    from structured_support import response_formats

    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "one two three four " * 10}]

    def ask(server) -> tuple[list, dict]:
        c = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)
        model = c.models.list().data[0].id
        out = []
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            reply = c.chat.completions.create(
                model=model, messages=messages, max_tokens=48,
                response_format=response_formats()["json_schema"], **sampling)
            out.append(reply.choices[0].message.content)
            call = c.chat.completions.create(
                model=model, messages=messages, max_tokens=64, tools=[tool],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                **sampling)
            calls = call.choices[0].message.tool_calls or []
            out.append([(t.function.name, t.function.arguments) for t in calls])
        async def stats():
            async with AsyncClient(server.address, timeout=60) as a:
                return await a.stats()
        return out, asyncio.run(stats())["speculative"]

    got = {}
    for mode, extra in (("ngram", ("--spec-cost", "none")), ("off", ())):
        server = Server(llama_model, "--speculative", mode, *extra, "--log-level", "warning")
        try:
            got[mode] = ask(server)
        finally:
            server.stop()
    assert got["ngram"][0] == got["off"][0]
    assert all(len(calls) == 1 for calls in got["ngram"][0][1::2])
    assert got["ngram"][1]["verifies"] > 0   # only constrained requests ran: they drafted


def test_a_hybrid_model_drafts_and_changes_no_token(hybrid_model):
    """A model with recurrent state verifies drafts through the real server (every
    proposal sent): the same tokens and logprobs as with speculation off, greedy
    ones as mlx_lm's."""
    path = hybrid_model("qwen3_next")
    outs = {}
    for mode, extra in (("ngram", ("--spec-cost", "none")), ("off", ())):
        server = Server(path, "--speculative", mode, *extra, "--log-level", "warning")
        try:
            outs[mode] = run_all(server)
        finally:
            server.stop()
    (on, stats), (off, _) = outs["ngram"], outs["off"]
    assert stats["speculative"]["verifies"] > 0 and stats["speculative"]["accepted_tokens"] > 0
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    want = [t for t, _ in reference_tokens(path, REQUESTS[0][1], MAX_TOKENS, ignore_eos=True)]
    assert on[0].token_ids == want
    assert stats["used_slots"] == 0


def test_a_draft_model_through_the_server(llama_model):
    """--draft-model (implying --speculative draft), the model drafting for itself:
    greedy rows as mlx_lm's and as speculation off's, every request's length kept,
    the accepted count in usage, stats and /metrics under method "draft"."""
    server = Server(llama_model, "--draft-model", llama_model, "--spec-cost", "none",
                    "--log-level", "warning")
    try:
        results, stats = run_all(server)
        with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        c = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)
        text = c.completions.create(model=c.models.list().data[0].id, prompt="one two three " * 8,
                                    max_tokens=24, temperature=0).choices[0].text
    finally:
        server.stop()
    off = Server(llama_model, "--speculative", "off", "--log-level", "warning")
    try:
        without, _ = run_all(off)
        c = openai.OpenAI(base_url=off.http_url + "/v1", api_key="none", max_retries=0)
        text_off = c.completions.create(model=c.models.list().data[0].id,
                                        prompt="one two three " * 8, max_tokens=24,
                                        temperature=0).choices[0].text
    finally:
        off.stop()
    spec = stats["speculative"]
    assert spec["method"] == "draft" and spec["verifies"] > 0 and spec["accepted_tokens"] > 0
    assert text == text_off
    for (params, _), a, b in zip(REQUESTS, results, without):
        assert a.usage["completion_tokens"] == MAX_TOKENS
        if not params:   # greedy: the tokens of speculation off (sampled: their distribution)
            assert a.token_ids == b.token_ids
    want = [t for t, _ in reference_tokens(llama_model, REQUESTS[0][1], MAX_TOKENS, ignore_eos=True)]
    assert results[0].token_ids == want
    assert sum(r.usage["accepted_tokens"] for r in results) == spec["accepted_tokens"]
    assert 'mlxd_spec_accepted_tokens_total{method="draft"}' in metrics
    assert stats["used_slots"] == 0


@pytest.mark.parametrize("args,says", [
    (("--speculative", "draft"), "needs --draft-model"),
    (("--speculative", "off", "--draft-model", "{model}"), "speculative is off"),
    (("--draft-model", "{other}"), "vocabulary"),
])
def test_draft_model_flags_that_cannot_serve_are_refused_clearly(args, says, llama_model,
                                                                  tmp_path):
    from mlxd.model_store.tiny import TinySpec, build_tiny_model

    other = build_tiny_model(tmp_path / "other", TinySpec(
        arch="llama", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=128, vocab_size=512, seed=5))   # a tokenizer of its own
    args = [a.format(model=llama_model, other=other) for a in args]
    with pytest.raises(RuntimeError, match=says):
        Server(llama_model, *args, ready_timeout=120)
