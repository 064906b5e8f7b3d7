"""tokenizer_proc as a real process under abuse: long prompts, oversized frames, floods
of garbage, messages of the wrong shape. The test plays the scheduler, as in
test_tokenizer_proc.py, whose harness it uses."""

from dataclasses import replace

import pytest
import zmq
import zmq.utils.monitor

from mlxd.protocol import AbortRequest, ErrorReply, GenerateRequest, StreamChunk, encode
from mlxd.protocol.to_tokenizer import MAX_MESSAGES, MAX_RID_CHARS
from support import RawDealer
from test_tokenizer_proc import LIMITS, RECV_TIMEOUT, TokenizerProc

FLOOD = 20_000


@pytest.fixture
def dealers(tok):
    made = []

    def make() -> RawDealer:
        made.append(RawDealer(tok.client_addr))
        return made[-1]
    yield make
    for d in made:
        d.close()


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def log_lines(tok: TokenizerProc) -> int:
    return tok.child.log_path.read_text(errors="replace").count("\n")


def completes(tok: TokenizerProc, dealer: RawDealer, rid: str, **fields) -> None:
    dealer.send(GenerateRequest(rid, stream=True, **fields))
    req = tok.take_request()
    tok.finish(req.rid)
    chunk = dealer.recv()
    assert isinstance(chunk, StreamChunk) and chunk.rid == rid, chunk
    assert chunk.finish_reason == "length"


# ---- the shape of messages ----------------------------------------------------------

def test_a_message_of_the_wrong_number_of_frames_is_a_bad_request(tok, dealers):
    d = dealers()
    d.sock.send_multipart([encode(GenerateRequest("a", prompt="hi")), b"more"])
    reply = d.recv()
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
    tok.assert_quiet()


def test_overlong_rids_and_too_many_messages_are_refused(tok, dealers):
    d = dealers()
    d.send(GenerateRequest("x" * (MAX_RID_CHARS + 1), prompt="hi"))
    reply = d.recv()
    assert reply.code == "bad_request" and str(MAX_RID_CHARS) in reply.message, reply
    messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    d.send(GenerateRequest("m", messages=messages))
    reply = d.recv()
    assert (reply.rid, reply.code) == ("m", "invalid_request"), reply
    assert str(MAX_MESSAGES) in reply.message
    tok.assert_quiet()
    completes(tok, d, "x" * MAX_RID_CHARS, input_ids=[1, 5])


# ---- sizes --------------------------------------------------------------------------

def test_an_oversized_frame_is_dropped_before_it_is_buffered(tok, dealers):
    size = 256 << 20
    peak = peak_rss_kb(tok.proc.pid)
    d = dealers()
    monitor = d.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        d.sock.send(b"\x00" * size)
        # ZeroMQ closes the connection of a peer whose frame exceeds the cap
        assert monitor.poll(RECV_TIMEOUT * 1000), "the oversized frame was taken in"
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        assert event == zmq.EVENT_DISCONNECTED
    finally:
        d.sock.disable_monitor()
        monitor.close(linger=0)
    assert peak_rss_kb(tok.proc.pid) - peak < size // 1024 // 4
    completes(tok, dealers(), "after", input_ids=[1, 5])


@pytest.fixture(scope="module")
def roomy_tok(llama_model, tmp_path_factory):
    """A context big enough for a prompt that takes seconds to encode."""
    tokens = 4_000_000
    with TokenizerProc(llama_model, tmp_path_factory.mktemp("roomy"), kv_capacity=tokens,
                       max_context=tokens, kv_pool_bytes=(tokens + 1) * 64) as t:
        yield t


def test_a_long_prompt_does_not_hold_up_another_clients_request(roomy_tok, tmp_path):
    tok = roomy_tok
    slow, quick = RawDealer(tok.client_addr), RawDealer(tok.client_addr)
    try:
        slow.send(GenerateRequest("long", prompt="hello world " * 300_000, stream=True))
        # the long one is encoding when this arrives (its frame takes milliseconds)
        assert not tok.requests.poll(300)
        quick.send(GenerateRequest("short", input_ids=[1, 5], stream=True))
        first = tok.take_request()
        assert first.input_ids == [1, 5], "the long prompt reached the scheduler first"
        tok.finish(first.rid)
        assert quick.recv().rid == "short"
        long = tok.take_request()
        assert len(long.input_ids) > 300_000
        tok.finish(long.rid)
        assert slow.recv().rid == "long"
    finally:
        slow.close()
        quick.close()


def test_an_abort_or_a_duplicate_while_a_long_prompt_encodes_is_honoured(roomy_tok):
    tok = roomy_tok
    d = RawDealer(tok.client_addr)
    try:
        d.send(GenerateRequest("long", prompt="hello world " * 300_000, stream=True))
        d.send(GenerateRequest("long", input_ids=[1, 5], stream=True))
        reply = d.recv()
        assert (reply.rid, reply.code) == ("long", "duplicate_rid"), reply
        d.send(AbortRequest("long"))
        req = tok.take_request()
        assert len(req.input_ids) > 300_000
        assert tok.take_abort().rid == req.rid
        tok.finish(req.rid, "abort")
        chunk = d.recv()
        assert (chunk.rid, chunk.finish_reason) == ("long", "abort"), chunk
    finally:
        d.close()


# ---- floods -------------------------------------------------------------------------

@pytest.fixture
def flooder(tok):
    """A client that queues all it sends (no high-water mark): it never blocks."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(tok.client_addr)
    yield sock
    sock.close(linger=0)
    ctx.term()


def test_a_flooding_client_neither_starves_others_nor_floods_the_log(tok, dealers, flooder):
    lines = log_lines(tok)
    normal = dealers()
    for _ in range(FLOOD):
        flooder.send(b"garbage")
    flooder.send(encode(GenerateRequest("last", input_ids=[1, 6])))
    for _ in range(50):   # the server is working through the flood
        assert flooder.poll(RECV_TIMEOUT * 1000)
        flooder.recv()
    normal.send(GenerateRequest("normal", input_ids=[1, 5], stream=True))
    first = tok.take_request()
    assert first.input_ids == [1, 5], "the normal request waited for the whole flood"
    tok.finish(first.rid)
    assert normal.recv().rid == "normal"
    assert tok.take_request().input_ids == [1, 6]
    assert log_lines(tok) - lines < 100


def test_the_frame_cap_holds_the_longest_prompt_that_can_fit(llama_model):
    from mlxd.tokenizer_proc.main import MIN_FRAME_BYTES, max_frame_bytes
    from mlxd.tokenizer_proc.text import TextCodec
    from mlxd.tokenizer_proc.validation import max_prompt_chars

    chars_per_token = TextCodec(llama_model).max_chars_per_token
    limits = replace(LIMITS, max_context=100_000, kv_capacity=200_000)
    longest = max_prompt_chars(limits, chars_per_token)
    frame = encode(GenerateRequest("r" * MAX_RID_CHARS, prompt="\U0001F600" * longest,
                                   params={"max_tokens": 10, "stop": ["x" * 100] * 4}))
    assert len(frame) <= max_frame_bytes(limits, chars_per_token)
    assert max_frame_bytes(LIMITS, None) >= MIN_FRAME_BYTES
