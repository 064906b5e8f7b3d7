"""The HTTP API of a real server, through the real `openai` and `anthropic` packages
(and raw httpx for what they would not send), against mlx_lm and the ZeroMQ SDK."""

import asyncio

import anthropic
import httpx
import openai
import pytest

from mlxd import AsyncClient, Client
from support import PROMPTS, encode, load_reference, reference_tokens

MAX_TOKENS = 24
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as client:
        yield client


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


def model_name(model_path: str) -> str:
    from pathlib import Path

    return Path(model_path).name


async def _http_completions(server, model_path, prompts, stream: bool):
    """(text, tokens, token logprobs, finish_reason, completion tokens) per prompt; the
    prompts go as token ids, so that the tokens compare with mlx_lm's."""
    async with openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="none",
                                  timeout=60, max_retries=0) as client:
        async def one(prompt):
            r = await client.completions.create(
                model=model_name(model_path), prompt=encode(model_path, prompt),
                max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stream=stream,
                **({"stream_options": {"include_usage": True}} if stream else {}))
            chunks = [c async for c in r] if stream else [r]
            choices = [c.choices[0] for c in chunks if c.choices]
            return ("".join(c.text for c in choices),
                    [t for c in choices if c.logprobs for t in c.logprobs.tokens],
                    [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs],
                    choices[-1].finish_reason, chunks[-1].usage.completion_tokens)
        return await asyncio.gather(*(one(p) for p in prompts))


async def _sdk_generate(address, prompts):
    async with AsyncClient(address, timeout=60) as c:
        return await asyncio.gather(*(c.generate(p, max_tokens=MAX_TOKENS) for p in prompts))


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_over_http_equals_the_sdk_and_mlx_lm_for_8_concurrent(server, llama_model,
                                                                     stream):
    http = asyncio.run(_http_completions(server, llama_model, PROMPTS, stream))
    sdk = asyncio.run(_sdk_generate(server.address, PROMPTS))
    _, tokenizer = load_reference(llama_model)
    for prompt, (text, tokens, logprobs, finish, n), s in zip(PROMPTS, http, sdk):
        ref = reference_tokens(llama_model, encode(llama_model, prompt), MAX_TOKENS)
        assert tokens == [tokenizer.decode([t]) for t, _ in ref], prompt
        assert max(abs(a - b) for a, (_, b) in zip(logprobs, ref)) < 1e-3
        assert text == s.text == tokenizer.decode([t for t, _ in ref], skip_special_tokens=True)
        assert finish == s.finish_reason
        assert n == len(ref) == len(s.token_ids)


def test_chat_streamed_equals_not_streamed_and_the_sdk(oai, server, llama_model):
    name = model_name(llama_model)
    whole = oai.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS)
    chunks = list(oai.chat.completions.create(
        model=name, messages=CHAT, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    with Client(server.address, timeout=60) as c:
        assert text == c.generate(messages=CHAT, max_tokens=MAX_TOKENS).text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # the second time the prompt's KV comes from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completion_prompt_forms_and_echo(oai, llama_model):
    name = model_name(llama_model)
    ids = encode(llama_model, PROMPTS[1])
    by_text = oai.completions.create(model=name, prompt=PROMPTS[1], max_tokens=8)
    by_ids = oai.completions.create(model=name, prompt=ids, max_tokens=8)
    assert by_text.choices[0].text == by_ids.choices[0].text
    several = oai.completions.create(model=name, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=8)
    lists = oai.completions.create(model=name, prompt=[ids, ids], max_tokens=8)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == by_text.choices[0].text == lists.choices[1].text
    assert several.usage.completion_tokens == 16
    echoed = oai.completions.create(model=name, prompt=PROMPTS[1], max_tokens=8, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + by_text.choices[0].text
    streamed = oai.completions.create(model=name, prompt=PROMPTS[1], max_tokens=8, echo=True,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_chat_logprobs_and_top_logprobs(oai, llama_model):
    r = oai.chat.completions.create(model=model_name(llama_model), messages=CHAT,
                                    max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token   # greedy: the most likely
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert entry.bytes == list(entry.token.encode())


def test_seeds_are_reproducible(oai, llama_model):
    def sample(seed):
        return oai.completions.create(model=model_name(llama_model), prompt=PROMPTS[0],
                                      max_tokens=16, temperature=1.0, seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(5)}) > 1   # the seed does change the sampling


def test_special_tokens_are_spelled_out_when_asked(oai, llama_model):
    """`skip_special_tokens` false keeps the special tokens' text (here BOS, forced by
    logit_bias), as vLLM's parameter of that name does."""
    def text(**extra):
        return oai.completions.create(model=model_name(llama_model), prompt=PROMPTS[0],
                                      max_tokens=3, logit_bias={"1": 100},
                                      extra_body=extra).choices[0].text
    assert text() == text(skip_special_tokens=True) == ""
    assert text(skip_special_tokens=False) == "<s><s><s>"


def test_stop_strings(oai, llama_model):
    name = model_name(llama_model)
    full = oai.completions.create(model=name, prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                                  extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[6:9]
    cut = oai.completions.create(model=name, prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                                 stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_anthropic_messages_equal_openai_chat(server, oai, llama_model):
    name = model_name(llama_model)
    chat = oai.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS)
    with anthropic.Anthropic(base_url=server.http_url, api_key="none", max_retries=0) as a:
        msg = a.messages.create(model=name, max_tokens=MAX_TOKENS, messages=CHAT)
        assert msg.content[0].text == chat.choices[0].message.content
        assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
            chat.choices[0].finish_reason]
        assert msg.usage.output_tokens == chat.usage.completion_tokens
        with a.messages.stream(model=name, max_tokens=MAX_TOKENS, messages=CHAT) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == final.content[0].text == msg.content[0].text
        assert final.usage.output_tokens == msg.usage.output_tokens
        stop = msg.content[0].text[4:7]
        cut = a.messages.create(model=name, max_tokens=MAX_TOKENS, messages=CHAT,
                                stop_sequences=[stop])
        assert cut.content[0].text == msg.content[0].text[:msg.content[0].text.index(stop)]
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        with pytest.raises(anthropic.NotFoundError):
            a.messages.create(model="nope", max_tokens=4, messages=CHAT)
        with pytest.raises(anthropic.BadRequestError) as exc:
            a.messages.create(model=name, max_tokens=4, messages=CHAT,
                              extra_body={"temperature": 3})
        assert exc.value.body["type"] == "error"


def test_n_choices(oai, llama_model):
    name = model_name(llama_model)
    ask = dict(model=name, messages=CHAT, max_tokens=8, n=3, temperature=1.0, seed=3)
    r = oai.chat.completions.create(**ask)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    texts = [c.message.content for c in r.choices]
    assert [c.message.content for c in oai.chat.completions.create(**ask).choices] == texts
    assert len(set(texts)) > 1   # each choice samples on its own
    assert 3 <= r.usage.completion_tokens <= 3 * 8
    streamed = {}
    for chunk in oai.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, n=2,
                                        stream=True, temperature=0):
        for c in chunk.choices:
            entry = streamed.setdefault(c.index, ["", None])
            entry[0] += c.text
            entry[1] = c.finish_reason or entry[1]
    assert sorted(streamed) == [0, 1] and all(f for _, f in streamed.values())
    assert streamed[0][0] == streamed[1][0]   # greedy: both choices alike


def test_penalties_and_logit_bias_pass_through(oai, server, llama_model):
    name = model_name(llama_model)
    token = encode(llama_model, " Paris")[-1]
    _, tokenizer = load_reference(llama_model)
    r = oai.completions.create(model=name, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                               logit_bias={str(token): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 5
    penalties = dict(frequency_penalty=2.0, presence_penalty=-1.5, repetition_penalty=1.7)
    over_http = oai.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, logprobs=0, extra_body={
                                           "repetition_penalty": 1.7},
                                       frequency_penalty=2.0, presence_penalty=-1.5)
    with Client(server.address, timeout=60) as sdk:   # formulas: tests/worker, tests/server
        direct = sdk.generate(PROMPTS[0], max_tokens=12, **penalties, logprobs=True)
    assert over_http.choices[0].text == direct.text
    assert over_http.choices[0].logprobs.token_logprobs == pytest.approx(direct.logprobs,
                                                                         abs=1e-4)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=name, prompt="x", max_tokens=2, presence_penalty=3)
    assert exc.value.body["param"] == "presence_penalty"


def _long_prompt_ids(n: int) -> list[int]:
    return [5 + i % 100 for i in range(n)]


def bad_inputs(name):
    chat = {"model": name, "messages": CHAT}
    return [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", {**chat, "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {**chat, "top_p": 5}, 400, "top_p"),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": -1}, 400,
         "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "regex", "regex": "(("}},
         400, "response_format"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}, 400,
         "response_format"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0"),
        ("/v1/chat/completions", {**chat, "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": CHAT}, 400, "model"),
        ("/v1/completions", {"model": name, "prompt": _long_prompt_ids(5000)}, 400, "prompt"),
        ("/v1/completions", {"model": name, "prompt": [10 ** 9]}, 400, "prompt"),
        ("/v1/completions", {"model": name, "prompt": "x", "echo": True, "logprobs": 1}, 400,
         "echo"),
        ("/v1/completions", {"model": name, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
        ("/v1/completions", {"model": name, "prompt": "x", "stream": True, "seed": -1}, 400,
         "seed"),
        ("/v1/completions", {"model": name, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": name, "prompt": [10 ** 9], "echo": True}, 400, "prompt"),
        ("/v1/completions", {"model": name, "prompt": "x", "stream_options": {
            "include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"model": name, "prompt": "x", "best_of": 2}, 400, "best_of"),
        ("/v1/messages", {"model": name, "messages": CHAT}, 400, None),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ]


def test_every_bad_input_is_answered_in_the_apis_shape(http, llama_model):
    name = model_name(llama_model)
    for path, body, status, param in bad_inputs(name):
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = http.post(path, **kwargs)
        assert r.status_code == status, (path, body, r.text)
        if path == "/v1/messages":
            assert r.json()["type"] == "error" and r.json()["error"]["type"]
        else:
            error = r.json()["error"]
            assert error["param"] == param and error["message"], (body, error)
    assert "context" in http.post("/v1/completions", json={
        "model": name, "prompt": _long_prompt_ids(5000)}).json()["error"]["message"]
    assert http.get("/health").status_code == 200   # still serving
    assert http.post("/v1/completions", json={"model": name, "prompt": "x",
                                              "max_tokens": 2}).status_code == 200


def test_models_tokenize_detokenize_health_metrics(http, llama_model):
    name = model_name(llama_model)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [name]
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    assert tokens == encode(llama_model, PROMPTS[1])
    _, tokenizer = load_reference(llama_model)
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == \
        tokenizer.decode(tokens, skip_special_tokens=True)
    assert http.get("/health").json() == {"status": "ok"}
    http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in ("mlxd_http_requests_total", "mlxd_time_to_first_token_seconds_bucket",
                 "mlxd_inter_token_latency_seconds_bucket", "mlxd_requests_running",
                 "mlxd_kv_slots_used", "mlxd_generation_tokens_total"):
        assert name in text, name
    assert 'mlxd_http_requests_total{endpoint="/v1/completions",status="200"}' in text

