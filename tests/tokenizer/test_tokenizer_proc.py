"""tokenizer_proc as a real process; the test plays the scheduler, clients use the SDK.

Sockets seen from the test (the tokenizer binds what it receives on):
  requests  DEALER "engine0" -> engines_addr     TokenizedRequest / Abort
  batches   the same socket                      SchedulerReady, then TokenBatch
  launcher  PULL bound at ready_addr             Ready("tokenizer", address)
  clients   Client / AsyncClient / raw DEALER -> tcp://127.0.0.1:<port>
"""

import asyncio
import concurrent.futures
import random
import socket
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import zmq

from mlxd.client import AsyncClient, Client, MlxdError
from mlxd.protocol import (
    Abort, Decoder, ErrorReply, GenerateRequest, Ready, SamplingParams, SchedulerReady,
    StreamChunk, TokenBatch, TokenEntry, TokenizedRequest, Usage, WorkerLimits, encode,
)
from proc_support import ProcHarness
from support import PROMPTS, RawDealer, encode as encode_prompt, load_reference

KV_CAPACITY = 1000
MAX_CONTEXT = 2048
DEFAULT_MAX_TOKENS = 16
EOS = 2                     # "</s>" in the tiny models' tokenizer
VOCAB = 512
READY_TIMEOUT = 60.0
RECV_TIMEOUT = 15.0
CLIENT_TIMEOUT = 15.0
QUIET = 0.3
LIMITS = WorkerLimits(kv_capacity=KV_CAPACITY, decode_cache_tokens=16384,
                      max_context=MAX_CONTEXT, vocab_size=VOCAB, bytes_per_token=64,
                      kv_pool_bytes=(KV_CAPACITY + 1) * 64, weights_bytes=1024,
                      buffer_cache_bytes=0, kv_dtype="float16", device="cpu", blas="test",
                      quantized=False, dequantize=False, overlap=True)


# ---- the tokenizer process and the fake scheduler ---------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TokenizerProc(ProcHarness):
    """`python -m tokenizer_proc` plus the scheduler's and launcher's sockets."""

    def __init__(self, model_path: str, tmp_path: Path, **limits):
        super().__init__("tokenizer", tmp_path, RECV_TIMEOUT)
        self.model_path = model_path
        self.limits = replace(LIMITS, **limits)
        self.start()

    def start(self) -> None:
        self.close_sockets()
        for name in ("engines", "ready"):
            Path(self.dir, name).unlink(missing_ok=True)
        self.launcher = self._socket(zmq.PULL, bind=self.ipc("ready"))
        self.requests = self.batches = self.ctx.socket(zmq.DEALER)
        self.batches.setsockopt(zmq.ROUTING_ID, b"engine0")
        self.batches.setsockopt(zmq.LINGER, 0)
        self.batches.connect(self.ipc("engines"))
        self.sockets.append(self.batches)
        self.client_addr = f"tcp://127.0.0.1:{free_port()}"
        self.start_child("-m", "mlxd.tokenizer_proc", "--model", self.model_path,
                         "--client-addr", self.client_addr,
                         "--engines-addr", self.ipc("engines"),
                         "--ready-addr", self.ipc("ready"),
                         "--default-max-tokens", str(DEFAULT_MAX_TOKENS), "--http-port", "0")
        self.batches.send(encode(SchedulerReady(self.limits, max_running_requests=64)))
        self.ready = self._recv(self.launcher, Decoder(Ready), "the launcher's Ready",
                                READY_TIMEOUT)

    # ---- playing the scheduler ---------------------------------------------

    def take(self):
        return self._recv(self.requests, Decoder(TokenizedRequest, Abort),
                          "message to the scheduler")

    def take_request(self) -> TokenizedRequest:
        msg = self.take()
        assert isinstance(msg, TokenizedRequest), msg
        return msg

    def take_abort(self) -> Abort:
        msg = self.take()
        assert isinstance(msg, Abort), msg
        return msg

    def assert_quiet(self, seconds: float = QUIET) -> None:
        if self.requests.poll(seconds * 1000):
            self.fail(f"unexpected message to the scheduler: {self.take()}")

    def drain(self) -> None:
        while self.requests.poll(20):
            self.requests.recv()

    def send(self, *entries: TokenEntry) -> None:
        self.batches.send(encode(TokenBatch(list(entries))))

    def finish(self, rid: int, reason: str = "length", prompt_tokens: int = 0) -> None:
        self.send(TokenEntry(rid, [], [], finish_reason=reason,
                             usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0,
                                         cached_tokens=0)))


@pytest.fixture
def client(tok):
    c = Client(tok.client_addr, timeout=CLIENT_TIMEOUT)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def bg(client):
    """Runs blocking SDK calls while the test plays the scheduler. Depends on `client`
    so that pending calls end (by the client's timeout at worst) before it closes."""
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)


@pytest.fixture
def dealer(tok):
    d = RawDealer(tok.client_addr)
    try:
        yield d
    finally:
        d.close()


def ref_tokenizer(model_path: str):
    return load_reference(model_path)[1]


def text_ids(model_path: str, text: str) -> list[int]:
    """Token ids of `text` without the BOS the tokenizer adds."""
    ids = encode_prompt(model_path, text)
    assert ids[0] == 1
    return ids[1:]


def serves_a_request(tok: TokenizerProc, client: Client) -> None:
    """The next message the scheduler gets is this fresh request, and it completes."""
    stream = client.stream(input_ids=[1, 77, 78], max_tokens=2)
    req = tok.take_request()
    assert req.input_ids == [1, 77, 78], f"an earlier request reached the scheduler: {req}"
    tok.send(TokenEntry(req.rid, [80, 81], [-0.5, -0.25], finish_reason="length"))
    chunks = list(stream)
    assert sum((c.token_ids for c in chunks), []) == [80, 81]
    assert chunks[-1].finish_reason == "length"


# ---- ready --------------------------------------------------------------------------

def test_ready_reports_the_client_address(tok, llama_model):
    assert tok.ready.process == "tokenizer"
    assert tok.ready.address == tok.client_addr
    # the constants these tests use describe the tiny model
    assert ref_tokenizer(llama_model).eos_token_ids == {EOS}
    assert len(ref_tokenizer(llama_model)._tokenizer) == VOCAB


# ---- requests to the scheduler ----------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS[:4] + ["Ünïcödé ½ € 日本語 😀 naïve café"])
def test_prompt_is_tokenized_like_the_model(tok, client, llama_model, prompt):
    stream = client.stream(prompt, max_tokens=5)
    req = tok.take_request()
    assert req.input_ids == encode_prompt(llama_model, prompt)
    assert req.max_new_tokens == 5
    assert req.sampling == SamplingParams()
    assert req.stop_token_ids == [EOS]
    tok.finish(req.rid)
    assert list(stream)[-1].finish_reason == "length"


def test_input_ids_default_max_tokens_and_kv_sized_prompt_pass_through(tok, client):
    small = client.stream(input_ids=[1, 5, 6, 7])   # kept: a dropped stream is aborted
    req = tok.take_request()
    assert req.input_ids == [1, 5, 6, 7] and req.max_new_tokens == DEFAULT_MAX_TOKENS
    # the largest that fits
    large = client.stream(input_ids=[5] * (KV_CAPACITY - 1), max_tokens=1)
    big = tok.take_request()
    assert len(big.input_ids) == KV_CAPACITY - 1 and big.rid != req.rid
    with pytest.raises(MlxdError) as err:   # as many as the pool holds: no room to decode
        client.generate(input_ids=[5] * KV_CAPACITY, max_tokens=1)
    assert err.value.code == "invalid_request"
    tok.finish(req.rid)
    tok.finish(big.rid)


def test_sampling_params_and_stop_token_ids(tok, client):
    kept = [client.stream("hello", temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=3,
                          logprobs=True, top_logprobs=2, stop_token_ids=[7, 9], max_tokens=4)]
    req = tok.take_request()
    assert req.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                                          seed=3, top_logprobs=2)
    assert req.max_new_tokens == 4
    assert sorted(req.stop_token_ids) == [EOS, 7, 9]

    kept.append(client.stream("hello", stop_token_ids=[7], ignore_eos=True, top_k=-1))
    req2 = tok.take_request()
    assert req2.stop_token_ids == [7] and req2.sampling.top_k == 0

    kept.append(client.stream("hello", ignore_eos=True))
    req3 = tok.take_request()
    assert req3.stop_token_ids == []
    for r in (req, req2, req3):
        tok.finish(r.rid)


MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Hello model server"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Write a sentence about water."}],
]


@pytest.mark.parametrize("messages", MESSAGES, ids=["one-turn", "multi-turn"])
def test_chat_messages_use_the_chat_template(tok, client, llama_model, messages):
    stream = client.stream(messages=messages, max_tokens=3)   # kept: dropped, it is aborted
    req = tok.take_request()
    expected = ref_tokenizer(llama_model).apply_chat_template(messages,
                                                               add_generation_prompt=True)
    assert req.input_ids == list(expected)
    assert req.input_ids[0] == 1                    # BOS, from the template only
    assert req.input_ids[1] != 1
    assert req.input_ids[-1] == ref_tokenizer(llama_model).convert_tokens_to_ids("<|assistant|>")
    tok.finish(req.rid)


# ---- output: streaming and whole results ----------------------------------------------

STREAM_TEXT = "Ünïcödé ½ € 日本語 😀 naïve café, the quick brown fox"


@pytest.mark.parametrize("stop", [None, ["zzzz", "?!"]], ids=["no-stop", "unmatched-stop"])
def test_stream_text_equals_the_full_decode(tok, client, llama_model, stop):
    """Held-back text (a possible stop string start) is flushed at the end."""
    ids = text_ids(llama_model, STREAM_TEXT)
    stream = client.stream("Hello", max_tokens=100, **({"stop": stop} if stop else {}))
    req = tok.take_request()
    # mostly one token per batch, sometimes two; other rids in a batch are not ours
    i = 0
    while i < len(ids):
        n = 2 if i % 5 == 4 else 1
        toks = ids[i:i + n]
        i += n
        last = i >= len(ids)
        tok.send(TokenEntry(req.rid + 1000, [5], [-1.0]),
                 TokenEntry(req.rid, toks, [-0.1] * len(toks),
                            finish_reason="length" if last else None,
                            usage=Usage(prompt_tokens=len(req.input_ids),
                                        completion_tokens=len(ids), cached_tokens=0)
                            if last else None))
    chunks = list(stream)
    text = "".join(c.text for c in chunks)
    assert text == ref_tokenizer(llama_model).decode(ids) == STREAM_TEXT
    assert all("\ufffd" not in c.text for c in chunks)
    assert sum((c.token_ids for c in chunks), []) == ids
    assert len(chunks) > 5, "the output was not streamed"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage == {"prompt_tokens": len(req.input_ids),
                                "completion_tokens": len(ids), "cached_tokens": 0,
                                "disk_tokens": 0, "pinned_tokens": 0, "accepted_tokens": 0, "resumes": 0}
    assert all(c.logprobs is None for c in chunks)


def test_generate_returns_one_result(tok, client, bg, llama_model):
    ids = text_ids(llama_model, "The capital of France is Paris.")
    fut = bg.submit(client.generate, "Hello", max_tokens=50, logprobs=True, top_logprobs=2)
    req = tok.take_request()
    lps = [-0.01 * (k + 1) for k in range(len(ids))]
    tops = [[[t, 3], [lp, -4.0]] for t, lp in zip(ids, lps)]
    for k in range(0, len(ids), 3):
        last = k + 3 >= len(ids)
        tok.send(TokenEntry(req.rid, ids[k:k + 3], lps[k:k + 3], tops[k:k + 3],
                            finish_reason="stop" if last else None,
                            usage=Usage(prompt_tokens=len(req.input_ids),
                                        completion_tokens=len(ids), cached_tokens=4)
                            if last else None))
    result = fut.result(RECV_TIMEOUT + CLIENT_TIMEOUT)
    assert result.text == ref_tokenizer(llama_model).decode(ids)
    assert result.token_ids == ids
    assert result.logprobs == lps
    assert result.top_logprobs == [{t: lp, 3: -4.0} for t, lp in zip(ids, lps)]
    assert result.finish_reason == "stop" and result.error is None
    assert result.usage == {"prompt_tokens": len(req.input_ids), "completion_tokens": len(ids),
                            "cached_tokens": 4, "disk_tokens": 0, "pinned_tokens": 0,
                            "accepted_tokens": 0, "resumes": 0}

    fut = bg.submit(client.generate, "Hello", max_tokens=50)       # no logprobs asked
    req = tok.take_request()
    tok.send(TokenEntry(req.rid, ids[:2], [-0.1, -0.2], [[[1], [-0.1]], [[2], [-0.2]]]))
    tok.send(TokenEntry(req.rid, ids[2:4], [-0.1, -0.2], finish_reason="length"))
    result = fut.result(RECV_TIMEOUT + CLIENT_TIMEOUT)
    assert result.token_ids == ids[:4] and result.finish_reason == "length"
    assert result.logprobs is None and result.top_logprobs is None


def test_non_stream_request_gets_exactly_one_chunk(tok, dealer, llama_model):
    ids = text_ids(llama_model, "a b c d e f g")
    dealer.send(GenerateRequest("one", prompt="a b", params={"max_tokens": 20}))
    req = tok.take_request()
    for k, t in enumerate(ids):
        tok.send(TokenEntry(req.rid, [t], [-0.5],
                            finish_reason="length" if k == len(ids) - 1 else None))
    chunk = dealer.recv()
    assert isinstance(chunk, StreamChunk) and chunk.rid == "one"
    assert chunk.token_ids == ids and chunk.finish_reason == "length"
    assert chunk.text == ref_tokenizer(llama_model).decode(ids)
    assert dealer.replies() == []


def test_worker_error_finish_reaches_the_client(tok, client, bg):
    fut = bg.submit(client.generate, "Hello", max_tokens=50)
    req = tok.take_request()
    tok.send(TokenEntry(req.rid, [300], [-0.1]))
    tok.send(TokenEntry(req.rid, [], [], finish_reason="error", error="worker failed"))
    result = fut.result(RECV_TIMEOUT + CLIENT_TIMEOUT)
    assert result.finish_reason == "error" and result.error == "worker failed"
    assert result.token_ids == [300]


# ---- stop strings and abort --------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False], ids=["stream", "generate"])
def test_stop_string_trims_the_text_and_aborts_the_request(tok, client, bg, llama_model,
                                                           stream):
    full = "The quick brown fox jumps over the lazy dog"
    ids = text_ids(llama_model, full)
    stop = ["lazy cat", "own f"]
    if stream:
        s = client.stream("Hello", max_tokens=100, stop=stop)
    else:
        fut = bg.submit(client.generate, "Hello", max_tokens=100, stop=stop)
    req = tok.take_request()
    for t in ids:
        tok.send(TokenEntry(req.rid, [t], [-0.1]))
    abort = tok.take_abort()
    assert abort.rid == req.rid
    # the scheduler's late tokens and its abort entry are ignored
    tok.send(TokenEntry(req.rid, [5], [-0.1]))
    tok.finish(req.rid, "abort")
    expected = full[:full.index("own f")]
    if stream:
        chunks = list(s)
        assert all("own f" not in c.text for c in chunks)
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        result = fut.result(RECV_TIMEOUT + CLIENT_TIMEOUT)
        text, reason = result.text, result.finish_reason
    assert text == expected and reason == "stop"
    serves_a_request(tok, client)


def test_client_abort_sends_abort_to_the_scheduler(tok, client):
    s = client.stream("Hello", max_tokens=100)
    req = tok.take_request()
    tok.send(TokenEntry(req.rid, [300], [-0.1]))
    first = next(s)
    assert first.token_ids == [300]
    s.abort()
    assert tok.take_abort().rid == req.rid
    client.abort("no-such-request")
    tok.assert_quiet()
    tok.finish(req.rid, "abort")
    rest = list(s)
    assert rest[-1].finish_reason == "abort"
    serves_a_request(tok, client)


# ---- bad input ---------------------------------------------------------------------------

INVALID = {
    "empty prompt": (("",), {}),
    "nothing to generate from": ((), {}),
    "prompt and input_ids": (("hi",), {"input_ids": [1, 2]}),
    "prompt and messages": (("hi",), {"messages": MESSAGES[0]}),
    "empty input_ids": ((), {"input_ids": []}),
    "input_id == vocab": ((), {"input_ids": [1, VOCAB]}),
    "negative input_id": ((), {"input_ids": [1, -1]}),
    "longer than kv_capacity": ((), {"input_ids": [5] * (KV_CAPACITY + 1)}),
    "longer than max_context": ((), {"input_ids": [5] * MAX_CONTEXT}),
    "prompt text too long": (("word " * 1200,), {}),
    "unknown parameter": (("hi",), {"foo": 1}),
    "vllm name": (("hi",), {"max_new_tokens": 5}),
    "temperature str": (("hi",), {"temperature": "0.5"}),
    "temperature bool": (("hi",), {"temperature": True}),
    "temperature nan": (("hi",), {"temperature": float("nan")}),
    "temperature < 0": (("hi",), {"temperature": -0.5}),
    "max_tokens float": (("hi",), {"max_tokens": 2.0}),
    "max_tokens str": (("hi",), {"max_tokens": "5"}),
    "max_tokens 0": (("hi",), {"max_tokens": 0}),
    "max_tokens < 0": (("hi",), {"max_tokens": -3}),
    "top_p 0": (("hi",), {"top_p": 0}),
    "top_p > 1": (("hi",), {"top_p": 1.5}),
    "top_k float": (("hi",), {"top_k": 1.5}),
    "top_k < -1": (("hi",), {"top_k": -2}),
    "min_p > 1": (("hi",), {"min_p": 1.5}),
    "min_p list": (("hi",), {"min_p": [0.1]}),
    "seed str": (("hi",), {"seed": "7"}),
    "seed < 0": (("hi",), {"seed": -1}),
    "logprobs str": (("hi",), {"logprobs": "yes"}),
    "ignore_eos int": (("hi",), {"ignore_eos": 1}),
    "top_logprobs without logprobs": (("hi",), {"top_logprobs": 3}),
    "top_logprobs too many": (("hi",), {"logprobs": True, "top_logprobs": 1000}),
    "stop int": (("hi",), {"stop": 5}),
    "stop empty string in list": (("hi",), {"stop": [""]}),
    "stop mixed": (("hi",), {"stop": ["a", 3]}),
    "stop_token_ids str": (("hi",), {"stop_token_ids": "2"}),
    "stop_token_ids out of vocab": (("hi",), {"stop_token_ids": [VOCAB]}),
    "messages empty": ((), {"messages": []}),
    "message without content": ((), {"messages": [{"role": "user"}]}),
    "message content int": ((), {"messages": [{"role": "user", "content": 5}]}),
    "message role int": ((), {"messages": [{"role": 1, "content": "hi"}]}),
    "message not a map": ((), {"messages": ["hello"]}),
    "message list of lists": ((), {"messages": [["user", "hello"]]}),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request_is_rejected_and_server_keeps_serving(tok, client, case):
    args, kwargs = INVALID[case]
    with pytest.raises(MlxdError) as err:
        client.generate(*args, **kwargs)
    assert err.value.code == "invalid_request", err.value
    assert err.value.message
    serves_a_request(tok, client)


def test_token_ids_the_model_cannot_embed_are_invalid(llama_model, tmp_path):
    """The worker's vocabulary bounds the ids, where a tokenizer knows more tokens than
    the model has embeddings for: input_ids, encoded prompts and stop_token_ids."""
    from transformers import AutoTokenizer

    model_vocab = VOCAB - 100
    tokenizer = AutoTokenizer.from_pretrained(llama_model)
    high = next(t for t in range(VOCAB - 1, model_vocab, -1)
                if max(tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False),
                       default=0) >= model_vocab)
    text = tokenizer.decode([high])
    with TokenizerProc(llama_model, tmp_path, vocab_size=model_vocab) as t, \
            Client(t.client_addr, timeout=CLIENT_TIMEOUT) as c:
        for args, kwargs in (((), {"input_ids": [1, model_vocab]}), ((text,), {}),
                             (("hi",), {"stop_token_ids": [model_vocab]})):
            with pytest.raises(MlxdError) as err:
                c.generate(*args, **kwargs)
            assert err.value.code == "invalid_request" and str(model_vocab) in err.value.message
        t.assert_quiet()   # nothing reached the scheduler
        serves_a_request(t, c)


WRONG_FIELD_TYPES = {
    "prompt int": ((5,), {}),
    "prompt list": ((["hello"],), {}),
    "input_ids floats": ((), {"input_ids": [1, 2.5]}),
    "input_ids strings": ((), {"input_ids": ["a"]}),
    "input_ids int": ((), {"input_ids": 7}),
    "messages str": ((), {"messages": "hello"}),
    "messages map": ((), {"messages": {"role": "user", "content": "hi"}}),
}


def test_wrongly_typed_request_fields_are_invalid_request(tok, client):
    """A type error in prompt / input_ids / messages is as much an invalid request as
    one in a sampling parameter, and must get the same code."""
    wrong = {}
    for case, (args, kwargs) in WRONG_FIELD_TYPES.items():
        with pytest.raises(MlxdError) as err:
            client.generate(*args, **kwargs)
        if err.value.code != "invalid_request":
            wrong[case] = str(err.value)
    serves_a_request(tok, client)
    assert not wrong, f"not answered with code invalid_request: {wrong}"


def test_params_with_non_string_keys_are_invalid_request(tok, dealer):
    dealer.sock.send(msgpack.packb([10, "odd", "hi", None, None, {1: 2, "foo": 3}, False]))
    reply = dealer.recv()
    assert isinstance(reply, ErrorReply) and reply.rid == "odd"
    assert reply.code == "invalid_request", reply
    tok.assert_quiet()


GARBAGE = [
    [b""],
    [b"garbage\x00\xff"],
    [b"\xc1"],
    [msgpack.packb({"rid": "x"})],
    [msgpack.packb([])],
    [msgpack.packb([999, "x"])],
    [msgpack.packb([10])],
    [msgpack.packb([10, 5, "hi", None, None, {}, False])],            # rid not a str
    [msgpack.packb([10, "g1", "hi", None, None, {}])],                # a field short
    [msgpack.packb([10, "g2", "hi", None, None, [], False])],         # params not a map
    [msgpack.packb([10, "g3", "hi", None, None, {}, "yes"])],         # stream not a bool
    [msgpack.packb([11])],
    [msgpack.packb([11, 5])],
    [encode(StreamChunk("x", "text", []))],
    [encode(TokenBatch([]))],
    [b"two", b"frames"],
    [encode(GenerateRequest("mf", prompt="hi")), b"extra frame"],
]


def test_garbage_frames_are_dropped_and_server_keeps_serving(tok, dealer, client):
    for frames in GARBAGE:
        dealer.sock.send_multipart(frames)
    replies = dealer.replies(0.5)
    assert len(replies) <= len(GARBAGE)
    for reply in replies:
        assert isinstance(reply, ErrorReply), reply
        # a readable rid makes it a request with bad fields; otherwise a bad frame
        assert reply.code == ("bad_request" if reply.rid is None else "invalid_request"), reply
    tok.assert_quiet()

    dealer.send(GenerateRequest("ok", prompt="Hello", params={"max_tokens": 3}, stream=True))
    req = tok.take_request()
    tok.send(TokenEntry(req.rid, [300, 301], [-0.1, -0.2], finish_reason="length"))
    chunk = dealer.recv()
    assert isinstance(chunk, StreamChunk) and chunk.rid == "ok", chunk
    assert chunk.token_ids == [300, 301] and chunk.finish_reason == "length"
    serves_a_request(tok, client)


def test_duplicate_rid_from_one_connection_is_rejected(tok, dealer):
    dealer.send(GenerateRequest("dup", prompt="Hello", stream=True))
    req = tok.take_request()
    dealer.send(GenerateRequest("dup", prompt="Hello again", stream=True))
    reply = dealer.recv()
    assert isinstance(reply, ErrorReply) and reply.rid == "dup"
    assert reply.code == "duplicate_rid"
    tok.assert_quiet()
    tok.finish(req.rid)
    assert dealer.recv().finish_reason == "length"


# ---- many clients ---------------------------------------------------------------------------

def test_two_clients_with_the_same_rid_do_not_interfere(tok, llama_model):
    c1 = Client(tok.client_addr, timeout=CLIENT_TIMEOUT)
    c2 = Client(tok.client_addr, timeout=CLIENT_TIMEOUT)
    try:
        s1 = c1.stream(input_ids=[1, 11], rid="same", max_tokens=10)
        r1 = tok.take_request()
        s2 = c2.stream(input_ids=[1, 22], rid="same", max_tokens=10)
        r2 = tok.take_request()
        assert r1.input_ids == [1, 11] and r2.input_ids == [1, 22] and r1.rid != r2.rid
        a = text_ids(llama_model, "water mountains")
        b = text_ids(llama_model, "people who live there")
        tok.send(TokenEntry(r1.rid, a[:1], [-0.1]), TokenEntry(r2.rid, b[:1], [-0.2]))
        first1, first2 = next(s1), next(s2)
        assert first1.token_ids == a[:1] and first2.token_ids == b[:1]

        s1.abort()                              # aborts c1's "same" only
        assert tok.take_abort().rid == r1.rid
        tok.assert_quiet()
        tok.finish(r1.rid, "abort")
        tok.send(TokenEntry(r2.rid, b[1:], [-0.2] * len(b[1:]), finish_reason="length"))
        all1, all2 = [first1, *s1], [first2, *s2]
        assert all1[-1].finish_reason == "abort"
        assert sum((c.token_ids for c in all1), []) == a[:1]
        assert all2[-1].finish_reason == "length"
        assert sum((c.token_ids for c in all2), []) == b
        decode = ref_tokenizer(llama_model).decode
        assert "".join(c.text for c in all1) == decode(a[:1])
        assert "".join(c.text for c in all2) == decode(b)
    finally:
        c1.close()
        c2.close()


def test_async_client_routes_20_concurrent_requests(tok, llama_model):
    n = 20

    async def run():
        async with AsyncClient(tok.client_addr, timeout=CLIENT_TIMEOUT) as ac:
            async def streamed(i):
                chunks = [c async for c in ac.stream(input_ids=[1, 100 + i, 200 + i],
                                                     rid=f"req-{i}", max_tokens=4)]
                return sum((c.token_ids for c in chunks), []), chunks[-1].finish_reason

            async def whole(i):
                r = await ac.generate(input_ids=[1, 100 + i, 200 + i], rid=f"req-{i}",
                                      max_tokens=4)
                assert r.rid == f"req-{i}"
                return r.token_ids, r.finish_reason

            return await asyncio.gather(*((streamed if i % 2 else whole)(i) for i in range(n)))

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(asyncio.run, run())
        reqs = {}
        for _ in range(n):
            req = tok.take_request()
            reqs[req.rid] = req.input_ids[1] - 100           # which i it is
        assert sorted(reqs.values()) == list(range(n))
        rng = random.Random(0)
        for step in range(4):
            entries = [TokenEntry(rid, [300 + i + step], [-0.1],
                                  finish_reason="length" if step == 3 else None)
                       for rid, i in reqs.items()]
            rng.shuffle(entries)
            tok.send(*entries)
        results = fut.result(RECV_TIMEOUT + CLIENT_TIMEOUT)
    finally:
        pool.shutdown(wait=True)
    for i, (token_ids, reason) in enumerate(results):
        assert token_ids == [300 + i + step for step in range(4)], i
        assert reason == "length"


# ---- lifecycle -------------------------------------------------------------------------------

def test_sigterm_exits_within_5s(llama_model, tmp_path):
    with TokenizerProc(llama_model, tmp_path) as t:
        code = t.child.sigterm(5)
        assert code == 0, t.log()


# ---- engines leaving and joining -----------------------------------------------------

def _reconnect_engine(tok: TokenizerProc, name: bytes) -> zmq.Socket:
    sock = tok.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, name)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tok.ipc("engines"))
    tok.sockets.append(sock)
    return sock


def test_a_lost_engine_s_requests_go_on_elsewhere_or_wait_for_one_to_join(tok, client, bg):
    import httpx

    engine0 = tok.batches
    engine1 = _reconnect_engine(tok, b"engine1")
    engine1.send(encode(SchedulerReady(tok.limits, max_running_requests=64)))
    health = f"{tok.ready.http_address}/health"
    decoder = Decoder(TokenizedRequest, Abort)
    # least-loaded first, ties by name: A -> engine0, B -> engine1, C -> engine0
    results = []
    for ids in ([1, 50], [1, 51], [1, 52]):
        results.append(bg.submit(client.generate, input_ids=ids, max_tokens=4))
        assert wait_for(lambda: engine0.poll(0) or engine1.poll(0))
        time.sleep(0.2)
    a, c = (tok._recv(engine0, decoder, "a request") for _ in range(2))
    b = tok._recv(engine1, decoder, "a request")
    assert (a.input_ids, b.input_ids, c.input_ids) == ([1, 50], [1, 51], [1, 52])
    engine0.send(encode(TokenBatch([TokenEntry(a.rid, [60], [-0.1])])))   # A streams
    time.sleep(0.2)
    engine0.close()   # engine0 goes: A resumes from its token so far, C runs again
    tok.sockets.remove(engine0)
    moved = sorted((tok._recv(engine1, decoder, "A and C, moved") for _ in range(2)),
                   key=lambda m: m.rid)
    assert [m.rid for m in moved] == sorted([a.rid, c.rid])
    moved_a, moved_c = moved if moved[0].rid == a.rid else moved[::-1]
    assert (moved_a.input_ids, moved_a.output_ids, moved_a.resumes) == ([1, 50], [60], 1)
    assert (moved_c.input_ids, moved_c.output_ids) == ([1, 52], [])
    engine1.send(encode(TokenBatch([TokenEntry(a.rid, [63], [0.0], finish_reason="length"),
                                    TokenEntry(b.rid, [61], [0.0], finish_reason="length"),
                                    TokenEntry(c.rid, [62], [0.0], finish_reason="length")])))
    assert results[0].result(CLIENT_TIMEOUT).token_ids == [60, 63]
    assert results[1].result(CLIENT_TIMEOUT).token_ids == [61]
    assert results[2].result(CLIENT_TIMEOUT).token_ids == [62]
    assert httpx.get(health).status_code == 200
    engine1.close()   # no engine left: health says so, a request waits for one
    tok.sockets.remove(engine1)
    assert wait_for(lambda: httpx.get(health).status_code == 503)
    waiting = bg.submit(client.generate, input_ids=[1, 53], max_tokens=4)
    time.sleep(0.3)
    assert not waiting.done()
    tok.requests = tok.batches = _reconnect_engine(tok, b"engine0")   # it comes back
    tok.batches.send(encode(SchedulerReady(tok.limits, max_running_requests=64)))
    parked = tok._recv(tok.batches, decoder, "the waiting request")
    assert parked.input_ids == [1, 53]
    tok.batches.send(encode(TokenBatch([TokenEntry(parked.rid, [64], [0.0],
                                                   finish_reason="length")])))
    assert waiting.result(CLIENT_TIMEOUT).token_ids == [64]
    assert wait_for(lambda: httpx.get(health).status_code == 200)
    serves_a_request(tok, client)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
