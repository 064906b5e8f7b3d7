"""The whole server (launch.py + three processes) against mlx_lm, through the SDK."""

import asyncio
import threading

import pytest
import zmq

from mlxd.client import AsyncClient, Client, MlxdError
from support import PROMPTS, Server, connect_client, encode, load_reference, reference_tokens

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def qwen3_server(qwen3_model):
    server = Server(qwen3_model, "--kv-capacity", "16384", "--log-level", "warning")
    yield server
    server.stop()


@pytest.fixture
def client(llama_server):
    with Client(llama_server.address, timeout=60) as c:
        yield c


def assert_matches(model_path, prompt, result):
    ref = reference_tokens(model_path, encode(model_path, prompt), MAX_TOKENS)
    assert result.token_ids == [t for t, _ in ref], prompt
    diffs = [abs(a - b) for a, (_, b) in zip(result.logprobs, ref)]
    assert max(diffs) < 1e-3, prompt
    assert result.finish_reason == ("stop" if len(ref) < MAX_TOKENS else "length")


async def generate_all(address, prompts, **params):
    async with AsyncClient(address, timeout=60) as c:
        return await asyncio.gather(*(c.generate(p, **params) for p in prompts))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_concurrent_greedy_matches_mlx_lm(arch, request):
    server = request.getfixturevalue(f"{arch}_server")
    model = request.getfixturevalue(f"{arch}_model")
    results = asyncio.run(generate_all(server.address, PROMPTS, max_tokens=MAX_TOKENS,
                                       logprobs=True))
    for prompt, result in zip(PROMPTS, results):
        assert_matches(model, prompt, result)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_prompt_alone_matches_mlx_lm(arch, request):
    server = request.getfixturevalue(f"{arch}_server")
    model = request.getfixturevalue(f"{arch}_model")
    with Client(server.address, timeout=60) as c:
        for prompt in PROMPTS:
            assert_matches(model, prompt, c.generate(prompt, max_tokens=MAX_TOKENS,
                                                     logprobs=True))


def test_stream_concatenates_to_the_decoded_text(client, llama_model):
    chunks = list(client.stream(PROMPTS[3], max_tokens=MAX_TOKENS))
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(c.finish_reason is None for c in chunks[:-1])
    token_ids = [t for c in chunks for t in c.token_ids]
    _, tokenizer = load_reference(llama_model)
    text = "".join(c.text for c in chunks)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert text == client.generate(PROMPTS[3], max_tokens=MAX_TOKENS).text
    usage = chunks[-1].usage
    n_prompt = len(encode(llama_model, PROMPTS[3]))
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n_prompt, len(token_ids))
    assert 0 <= usage["cached_tokens"] < n_prompt


def test_input_ids_and_chat(client, llama_model):
    ids = encode(llama_model, PROMPTS[1])
    assert client.generate(input_ids=ids, max_tokens=8).token_ids == \
        client.generate(PROMPTS[1], max_tokens=8).token_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    _, tokenizer = load_reference(llama_model)
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    result = client.chat(messages, max_tokens=8)
    assert result.usage["prompt_tokens"] == len(chat_ids)
    assert result.token_ids == client.generate(input_ids=chat_ids, max_tokens=8).token_ids


def test_top_logprobs(client):
    result = client.generate(PROMPTS[0], max_tokens=6, logprobs=True, top_logprobs=3)
    assert len(result.top_logprobs) == len(result.token_ids) == 6
    for token, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token
        assert top[token] == pytest.approx(lp)
    assert client.generate(PROMPTS[0], max_tokens=2).logprobs is None


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llama_server):
    params = dict(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=42)
    with Client(llama_server.address, timeout=60) as c:
        alone = c.generate(PROMPTS[2], **params).token_ids
        assert c.generate(PROMPTS[2], **params).token_ids == alone
        other_seed = c.generate(PROMPTS[2], **{**params, "seed": 43}).token_ids
    crowd = asyncio.run(generate_all(llama_server.address, [PROMPTS[2]] + PROMPTS, **params))
    assert crowd[0].token_ids == alone
    assert other_seed != alone


def test_stop_string_and_stop_token(client):
    greedy = client.generate(PROMPTS[6], max_tokens=MAX_TOKENS)
    stop = greedy.text[5:8]
    cut = greedy.text.index(stop)
    result = client.generate(PROMPTS[6], max_tokens=MAX_TOKENS, stop=[stop])
    assert result.finish_reason == "stop" and result.text == greedy.text[:cut]
    streamed = list(client.stream(PROMPTS[6], max_tokens=MAX_TOKENS, stop=stop))
    assert "".join(c.text for c in streamed) == greedy.text[:cut]
    assert streamed[-1].finish_reason == "stop"
    token = greedy.token_ids[3]
    by_token = client.generate(PROMPTS[6], max_tokens=MAX_TOKENS, stop_token_ids=[token])
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == greedy.token_ids[:greedy.token_ids.index(token) + 1]


def test_max_tokens_one_and_ignore_eos(client):
    one = client.generate(PROMPTS[0], max_tokens=1)
    assert len(one.token_ids) == 1 and one.finish_reason in ("length", "stop")
    long = client.generate(PROMPTS[0], max_tokens=200, ignore_eos=True)
    assert len(long.token_ids) == 200 and long.finish_reason == "length"


def test_abort_mid_stream_then_serve_next(client):
    stream = client.stream(PROMPTS[0], max_tokens=1500, ignore_eos=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            stream.abort()
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 1500
    assert client.generate(PROMPTS[1], max_tokens=4).finish_reason in ("length", "stop")


def test_client_is_shared_across_threads(client, llama_model):
    results = {}

    def work(i):
        results[i] = client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, logprobs=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(PROMPTS):
        assert_matches(llama_model, prompt, results[i])


BAD_INPUTS = [
    ({"prompt": ""}, "empty"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1] * 3000}, "context"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "best_of": 2}, "unknown"),
    ({"prompt": "hi", "frequency_penalty": 3.0}, "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "stop": [1, 2]}, "stop"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"prompt": "hi", "input_ids": [1, 2]}, "exactly one"),
]


@pytest.mark.parametrize("kwargs,words", BAD_INPUTS)
def test_bad_input_gets_a_clear_error(client, kwargs, words):
    with pytest.raises(MlxdError) as err:
        client.generate(**kwargs)
    assert err.value.code == "invalid_request"
    assert words in err.value.message
    assert client.generate(PROMPTS[0], max_tokens=2).finish_reason in ("length", "stop")


def test_garbage_frames_do_not_hurt_the_server(llama_server, client):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_client(sock, llama_server.address)
    try:
        for frame in [b"", b"\xff\x00garbage", b"\x93\x01\x02\x03", b"\x92\x0a\xc0"]:
            sock.send(frame)
        sock.send_multipart([b"two", b"frames"])
        assert client.generate(PROMPTS[0], max_tokens=4).finish_reason in ("length", "stop")
    finally:
        sock.close()
        ctx.term()
    assert llama_server.proc.poll() is None
