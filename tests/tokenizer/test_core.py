"""tokenizer_proc/core.py: validation, request state and fan-out, without sockets.

The tests play both sides: front ends (client keys, each with a list as its sink) and
the scheduler (the messages the core returns, and TokenBatch / Stats fed back)."""

from types import SimpleNamespace

import pytest

from mlxd.protocol import (
    Abort, AbortRequest, ErrorReply, GenerateRequest, GetStats, ProtocolError,
    SamplingParams, Stats, StatsReply, StatsRequest, StreamChunk, TokenBatch, TokenEntry,
    TokenizedRequest, Usage,
)
from mlxd.tokenizer_proc.core import TokenizerCore, protocol_error_reply
from mlxd.tokenizer_proc.text import TextCodec
from support import worker_limits

BOS, EOS = 1, 2             # "<s>", "</s>" in the tiny models' tokenizer
VOCAB = 512
KV_CAPACITY = 100
MAX_CONTEXT = 200
DEFAULT_MAX_TOKENS = 16
LIMITS = worker_limits(kv_capacity=KV_CAPACITY, max_context=MAX_CONTEXT, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def codec(llama_model):
    return TextCodec(llama_model)


@pytest.fixture
def core(codec):
    return TokenizerCore(codec, DEFAULT_MAX_TOKENS, LIMITS)


class Peer:
    """One client key of a front end; every reply the core routes to it lands in `got`."""

    def __init__(self, core: TokenizerCore, key):
        self.core, self.key, self.got = core, key, []

    def submit(self, rid="r", **fields) -> list:
        return self.core.submit(self.key, GenerateRequest(rid, **fields), self.got.append)

    def submitted(self, rid="r", **fields) -> TokenizedRequest:
        [req] = self.submit(rid, **fields)
        assert isinstance(req, TokenizedRequest) and self.got == [], self.got
        return req

    def rejected(self, rid="r", **fields) -> ErrorReply:
        assert self.submit(rid, **fields) == []
        [reply] = self.got
        assert isinstance(reply, ErrorReply) and reply.rid == rid, reply
        self.got.clear()
        return reply

    def take(self) -> list:
        got, self.got = self.got, []
        return got


def text_ids(codec: TextCodec, text: str) -> list[int]:
    return codec.tokenizer.encode(text, add_special_tokens=False)


def entry(rid: int, ids: list[int], finish: str | None = None, usage=None) -> TokenEntry:
    return TokenEntry(rid, ids, [-0.5] * len(ids), finish_reason=finish, usage=usage)


def joined(chunks) -> str:
    return "".join(c.text for c in chunks)


# ---- admission --------------------------------------------------------------------

def test_a_prompt_becomes_a_tokenized_request(core, codec):
    a = Peer(core, b"a")
    req = a.submitted("r1", prompt="Hello world", params={"temperature": 0.5, "seed": 3})
    assert req.input_ids == codec.encode_prompt("Hello world") and req.input_ids[0] == BOS
    assert req.sampling == SamplingParams(temperature=0.5, seed=3)
    assert req.max_new_tokens == DEFAULT_MAX_TOKENS and req.stop_token_ids == [EOS]
    ignoring = a.submitted("r2", input_ids=[BOS, 5], params={"ignore_eos": True,
                                                             "stop_token_ids": [7]})
    assert ignoring.stop_token_ids == [7] and ignoring.rid != req.rid
    assert core.stats() == {"streams": 2}
    core.check_integrity()


def test_chat_messages_go_through_the_chat_template(core, codec):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    req = Peer(core, b"a").submitted(messages=messages)
    user, assistant = codec.tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    assert req.input_ids == [BOS, user, *text_ids(codec, messages[0]["content"]), EOS,
                             assistant]


MESSAGES = [{"role": "user", "content": "hello"}]
INVALID = {
    "empty prompt": {"prompt": ""},
    "nothing to generate from": {},
    "prompt and input_ids": {"prompt": "hi", "input_ids": [BOS, 5]},
    "prompt and messages": {"prompt": "hi", "messages": MESSAGES},
    "empty input_ids": {"input_ids": []},
    "input_id == vocab": {"input_ids": [BOS, VOCAB]},
    "negative input_id": {"input_ids": [BOS, -1]},
    "as long as the KV pool": {"input_ids": [5] * KV_CAPACITY},
    "prompt text too long": {"prompt": "word " * KV_CAPACITY},
    "unknown parameter": {"prompt": "hi", "params": {"max_new_tokens": 5}},
    "temperature str": {"prompt": "hi", "params": {"temperature": "0.5"}},
    "skip_special_tokens str": {"prompt": "hi", "params": {"skip_special_tokens": "no"}},
    "max_tokens 0": {"prompt": "hi", "params": {"max_tokens": 0}},
    "stop_token_ids out of vocab": {"prompt": "hi", "params": {"stop_token_ids": [VOCAB]}},
    "messages empty": {"messages": []},
    "message without content": {"messages": [{"role": "user"}]},
    "message role int": {"messages": [{"role": 1, "content": "hi"}]},
    "message not a map": {"messages": ["hello"]},
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_are_answered_and_nothing_reaches_the_scheduler(core, case):
    a = Peer(core, b"a")
    reply = a.rejected("bad", **INVALID[case])
    assert reply.code == "invalid_request" and reply.message
    assert core.stats() == {"streams": 0}
    core.check_integrity()
    a.submitted("bad", input_ids=[BOS, 5])   # the rid was not taken


def test_the_context_bounds_prompts_when_it_is_the_smaller_limit(codec):
    core = TokenizerCore(codec, DEFAULT_MAX_TOKENS, worker_limits(kv_capacity=1000, max_context=50, vocab_size=VOCAB))
    a = Peer(core, b"a")
    assert "context is 50" in a.rejected(input_ids=[5] * 50).message
    assert len(a.submitted(input_ids=[5] * 49).input_ids) == 49


def test_the_models_vocabulary_bounds_ids_once_the_worker_reports_it(codec):
    """A tokenizer may know more tokens than the model has embeddings for: input_ids,
    encoded prompts and stop_token_ids are checked against the worker's figure."""
    model_vocab = VOCAB - 100
    high = next(t for t in range(VOCAB - 1, model_vocab, -1)
                if max(text_ids(codec, codec.decode([t])), default=0) >= model_vocab)
    core = TokenizerCore(codec, DEFAULT_MAX_TOKENS, worker_limits(kv_capacity=10**6, max_context=10**6, vocab_size=model_vocab))
    a = Peer(core, b"a")
    for fields in ({"input_ids": [BOS, model_vocab]}, {"prompt": codec.decode([high])},
                   {"prompt": "hi", "params": {"stop_token_ids": [model_vocab]}}):
        assert str(model_vocab) in a.rejected(**fields).message, fields
    a.submitted(input_ids=[BOS, model_vocab - 1])


def test_before_ready_the_tokenizers_vocabulary_applies_and_lengths_are_unchecked(codec):
    core = TokenizerCore(codec, DEFAULT_MAX_TOKENS)
    a = Peer(core, b"a")
    assert a.rejected(input_ids=[BOS, VOCAB]).code == "invalid_request"
    assert len(a.submitted(input_ids=[5] * 5000).input_ids) == 5000


def test_limits_may_be_any_object_with_the_three_attributes(codec):
    limits = SimpleNamespace(kv_capacity=10, max_context=20, vocab_size=300, extra=1)
    a = Peer(TokenizerCore(codec, DEFAULT_MAX_TOKENS, limits), b"a")
    assert "KV cache holds 10" in a.rejected(input_ids=[5] * 10).message
    assert "[0, 300)" in a.rejected(input_ids=[BOS, 300]).message



def test_an_unexpected_failure_is_an_internal_error_and_the_core_keeps_serving(
        core, codec, monkeypatch):
    def broken(prompt):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(codec, "encode_prompt", broken)
    a = Peer(core, b"a")
    reply = a.rejected("x", prompt="hello")
    assert reply.code == "internal_error" and "tokenizer exploded" in reply.message
    monkeypatch.undo()
    a.submitted("x", prompt="hello")
    core.check_integrity()


def test_protocol_errors_are_bad_request_without_an_rid_else_invalid_request():
    assert protocol_error_reply(ProtocolError("garbage")).code == "bad_request"
    reply = protocol_error_reply(ProtocolError("prompt must be a str", rid="r7"))
    assert (reply.rid, reply.code, reply.message) == ("r7", "invalid_request",
                                                      "prompt must be a str")


# ---- rids per client key ----------------------------------------------------------------

def test_a_duplicate_rid_is_refused_per_client_key(core):
    a, b = Peer(core, b"a"), Peer(core, ("http", 1))
    first = a.submitted("dup", input_ids=[BOS, 5])
    assert a.rejected("dup", input_ids=[BOS, 6]).code == "duplicate_rid"
    other = b.submitted("dup", input_ids=[BOS, 7])   # another client may use it
    assert other.rid != first.rid and core.stats() == {"streams": 2}
    assert core.on_batch(TokenBatch([entry(first.rid, [9], "length")])) == []
    assert a.take()[-1].finish_reason == "length"
    a.submitted("dup", input_ids=[BOS, 5])          # finished: free again
    core.check_integrity()


def test_aborts_are_routed_by_client_key(core, codec):
    a, b = Peer(core, b"a"), Peer(core, b"b")
    ra = a.submitted("same", prompt="hi", stream=True)
    rb = b.submitted("same", prompt="hi", stream=True)
    assert core.abort(b"a", "same") == [Abort(ra.rid)]
    assert core.abort(b"b", "unknown") == [] and core.abort(b"c", "same") == []
    ids = text_ids(codec, "water")
    core.on_batch(TokenBatch([entry(ra.rid, [], "abort"), entry(rb.rid, ids)]))
    [aborted] = a.take()
    assert aborted.rid == "same" and aborted.finish_reason == "abort"
    [chunk] = b.take()
    assert chunk.token_ids == ids and chunk.finish_reason is None
    assert core.stats() == {"streams": 1}
    core.check_integrity()


def test_handle_dispatches_the_three_client_messages(core):
    a = Peer(core, b"a")
    [req] = core.handle(b"a", GenerateRequest("r", input_ids=[BOS, 5]), a.got.append)
    assert isinstance(req, TokenizedRequest)
    assert core.handle(b"a", AbortRequest("r"), a.got.append) == [Abort(req.rid)]
    [query] = core.handle(b"a", StatsRequest("s"), a.got.append)
    assert isinstance(query, GetStats) and a.got == []
    with pytest.raises(TypeError):
        core.handle(b"a", StreamChunk("r", "", []), a.got.append)


# ---- output ----------------------------------------------------------------------------

def test_chunks_fan_out_to_each_requests_own_sink(core, codec):
    """One batch carries both clients' tokens (and a rid the core does not know)."""
    a, b = Peer(core, b"a"), Peer(core, ("http", 7))
    ra = a.submitted("x", prompt="hi", stream=True)
    rb = b.submitted("y", prompt="hi", stream=False)
    ta, tb = text_ids(codec, "the quick brown fox"), text_ids(codec, "water mountains")
    for i in range(max(len(ta), len(tb))):
        last_a, last_b = i == len(ta) - 1, i == len(tb) - 1
        entries = [entry(ra.rid, ta[i:i + 1], "length" if last_a else None),
                   entry(rb.rid, tb[i:i + 1], "length" if last_b else None,
                         Usage(len(rb.input_ids), i + 1, 0) if last_b else None),
                   entry(9999, [5])]
        assert core.on_batch(TokenBatch([e for e in entries if e.token_ids])) == []
    got_a, got_b = a.take(), b.take()
    assert all(isinstance(c, StreamChunk) and c.rid == "x" for c in got_a)
    assert len(got_a) > 1 and joined(got_a) == codec.decode(ta)
    assert sum((c.token_ids for c in got_a), []) == ta
    [whole] = got_b   # not streamed: one chunk at the end
    assert whole.rid == "y" and whole.text == codec.decode(tb) and whole.token_ids == tb
    assert whole.finish_reason == "length"
    assert whole.usage == {"prompt_tokens": len(rb.input_ids), "completion_tokens": len(tb),
                           "cached_tokens": 0, "disk_tokens": 0, "pinned_tokens": 0, "accepted_tokens": 0, "resumes": 0}
    assert core.stats() == {"streams": 0}
    core.check_integrity()


@pytest.mark.parametrize("skip", [None, True, False])
def test_special_tokens_are_left_out_of_the_text_unless_asked_for(core, codec, skip):
    a = Peer(core, b"a")
    params = {} if skip is None else {"skip_special_tokens": skip}
    req = a.submitted("x", prompt="hi", params=params)
    ids = [BOS] + text_ids(codec, "water") + [EOS]
    assert core.on_batch(TokenBatch([entry(req.rid, ids, "length")])) == []
    [whole] = a.take()
    assert whole.token_ids == ids
    if skip is False:
        assert whole.text == codec.decode_all(ids) and whole.text.startswith("<s>")
    else:
        assert whole.text == codec.decode(ids) == "water"


def test_a_stop_string_finishes_the_request_and_aborts_it_in_the_scheduler(core, codec):
    full = "The quick brown fox jumps over the lazy dog"
    a = Peer(core, b"a")
    req = a.submitted(prompt="hi", stream=True, params={"stop": ["lazy cat", "own f"]})
    aborts = [core.on_batch(TokenBatch([entry(req.rid, [t])])) for t in text_ids(codec, full)]
    assert [x for x in aborts if x] == [[Abort(req.rid)]]   # once, at the hit
    chunks = a.take()
    assert joined(chunks) == full[:full.index("own f")]
    assert chunks[-1].finish_reason == "stop"
    # the scheduler's late tokens and its abort entry reach nobody
    assert core.on_batch(TokenBatch([entry(req.rid, [5]), entry(req.rid, [], "abort")])) == []
    assert a.got == [] and core.stats() == {"streams": 0}
    core.check_integrity()


def test_stats_answers_go_to_the_client_that_asked(core):
    a, b = Peer(core, b"a"), Peer(core, b"b")
    a.submitted("r", input_ids=[BOS, 5])
    [qa] = core.query_stats(b"a", "sa", a.got.append)
    [qb] = core.query_stats(b"b", "sb", b.got.append)
    assert qa.query_id != qb.query_id
    core.on_stats(Stats(qb.query_id, {"waiting": 3}))
    core.on_stats(Stats(12345, {"waiting": 0}))   # nobody asked: dropped
    assert a.got == [] and b.take() == [StatsReply("sb", {"waiting": 3,
                                                          "tokenizer": {"streams": 1}})]
    core.on_stats(Stats(qa.query_id, {"waiting": 4}))
    assert a.take() == [StatsReply("sa", {"waiting": 4, "tokenizer": {"streams": 1}})]
    core.on_stats(Stats(qa.query_id, {"waiting": 5}))   # answered once only
    assert a.got == []


def test_forgetting_a_client_aborts_its_requests_and_silences_it(core):
    a, b = Peer(core, b"a"), Peer(core, b"b")
    r1 = a.submitted("1", input_ids=[BOS, 5], stream=True)
    r2 = a.submitted("2", input_ids=[BOS, 6], stream=True)
    rb = b.submitted("1", input_ids=[BOS, 7], stream=True)
    [qa] = core.query_stats(b"a", "s", a.got.append)
    assert sorted(core.forget(b"a"), key=lambda m: m.rid) == [Abort(r1.rid), Abort(r2.rid)]
    assert core.stats() == {"streams": 1}
    core.check_integrity()
    core.on_batch(TokenBatch([entry(r1.rid, [9]), entry(r2.rid, [], "abort"),
                              entry(rb.rid, [9])]))
    core.on_stats(Stats(qa.query_id, {}))
    assert a.got == [] and [c.token_ids for c in b.take()] == [[9]]
    assert core.abort(b"a", "1") == [] and core.forget(b"a") == []
    a.submitted("1", input_ids=[BOS, 5])   # the key may come back with the same rid
    core.check_integrity()


# ---- prompt size, and requests between validation and admission -------------------

class Counting:
    """A codec that counts what it encodes."""

    def __init__(self, codec):
        self.codec, self.encoded = codec, 0

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def encode_prompt(self, prompt):
        self.encoded += 1
        return self.codec.encode_prompt(prompt)


def test_a_prompt_too_long_to_fit_is_rejected_before_it_is_encoded(codec):
    counting = Counting(codec)
    a = Peer(TokenizerCore(counting, DEFAULT_MAX_TOKENS, LIMITS), b"a")
    bound = KV_CAPACITY * codec.max_chars_per_token   # the smaller of the two limits
    reply = a.rejected(prompt="x" * (bound + 1))
    assert reply.code == "invalid_request" and str(bound) in reply.message
    assert counting.encoded == 0
    # at the bound it is encoded, and then rejected for its token count
    assert "tokens" in a.rejected(prompt="x" * bound).message and counting.encoded == 1


def test_the_character_bound_covers_every_token_of_the_vocabulary(codec):
    longest = max(len(codec.decode([i])) for i in range(len(codec.tokenizer)))
    assert 1 <= longest <= codec.max_chars_per_token


def test_rendered_chat_text_too_long_to_fit_is_rejected_before_it_is_encoded(codec):
    class NoEncoding(Counting):
        def encode_rendered(self, text):
            raise AssertionError("encoded")

    a = Peer(TokenizerCore(NoEncoding(codec), DEFAULT_MAX_TOKENS, LIMITS), b"a")
    content = "x" * (KV_CAPACITY * codec.max_chars_per_token)
    reply = a.rejected(messages=[{"role": "user", "content": content}])
    assert reply.code == "invalid_request" and "characters" in reply.message


@pytest.mark.parametrize("normalizer, factor", [
    (None, 1), ({"type": "NFC"}, 4), ({"type": "Lowercase"}, 1),
    ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "_"},
                                          {"type": "NFKC"}]}, 4),
    ({"type": "Replace", "pattern": {"String": " "}, "content": "_"}, 1),
    ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, None),
    ({"type": "Strip", "strip_left": True, "strip_right": True}, None),
    ({"type": "BertNormalizer"}, None),
])
def test_normalizers_that_may_shrink_text_widen_or_drop_the_bound(normalizer, factor):
    from mlxd.tokenizer_proc.text import _shrink_factor
    assert _shrink_factor(normalizer) == factor


def validated(core, peer, rid="r", **fields):
    pending = core.validate(peer.key, GenerateRequest(rid, **fields), peer.got.append)
    assert pending is not None and peer.got == [], peer.got
    core.encode(pending)
    return pending


def test_an_abort_while_encoding_aborts_the_request_once_admitted(core):
    a = Peer(core, b"a")
    pending = validated(core, a, prompt="Hello")
    assert core.abort(b"a", "r") == []
    core.check_integrity()
    req, abort = core.admit(pending)
    assert isinstance(req, TokenizedRequest) and abort == Abort(req.rid)
    core.check_integrity()


def test_a_duplicate_rid_while_encoding_is_refused(core):
    a = Peer(core, b"a")
    pending = validated(core, a, prompt="Hello")
    assert a.rejected(prompt="Hi").code == "duplicate_rid"
    [req] = core.admit(pending)
    assert isinstance(req, TokenizedRequest)


def test_a_client_forgotten_while_encoding_gets_nothing(core):
    a = Peer(core, b"a")
    pending = validated(core, a, prompt="Hello")
    assert core.forget(b"a") == []
    assert core.admit(pending) == [] and a.got == []
    core.check_integrity()


def test_a_rejection_while_encoding_frees_the_rid(core):
    a = Peer(core, b"a")
    pending = validated(core, a, input_ids=[VOCAB])   # found out of range when encoding
    assert core.admit(pending) == []
    [reply] = a.take()
    assert reply.code == "invalid_request"
    core.check_integrity()
    a.submitted(input_ids=[5])


def test_a_failed_client_gets_a_final_error_chunk_per_request(core, codec):
    a, b = Peer(core, b"a"), Peer(core, b"b")
    ra = a.submitted("x", prompt="hi", stream=True)
    rb = b.submitted("y", prompt="hi", stream=True)
    ids = text_ids(codec, "the quick")
    core.on_batch(TokenBatch([entry(ra.rid, ids[:1], usage=Usage(len(ra.input_ids), 1, 0)),
                              entry(rb.rid, ids[:1])]))
    aborts = core.fail_client(b"a", "fell behind")
    assert aborts == [Abort(ra.rid)]
    first, final = a.take()
    assert first.finish_reason is None and first.token_ids == ids[:1]
    assert final.finish_reason == "error" and final.error == "fell behind"
    assert final.usage == {"prompt_tokens": len(ra.input_ids), "completion_tokens": 1,
                           "cached_tokens": 0, "disk_tokens": 0, "pinned_tokens": 0, "accepted_tokens": 0, "resumes": 0}
    assert core.abort(b"a", "x") == [] and core.stats() == {"streams": 1}
    core.check_integrity()


def test_a_request_ended_before_its_first_token_still_reports_usage(core):
    """The scheduler's usage comes with the first token; a request ended before it
    (its client fell behind, or its deadline passed) reports its prompt's count."""
    a = Peer(core, b"a")
    ra = a.submitted("x", prompt="hi there", stream=True)
    core.fail_client(b"a", "fell behind")
    [final] = a.take()
    assert final.finish_reason == "error"
    assert final.usage == {"prompt_tokens": len(ra.input_ids), "completion_tokens": 0,
                           "cached_tokens": 0, "disk_tokens": 0, "pinned_tokens": 0, "accepted_tokens": 0, "resumes": 0}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_requests_past_their_deadline_end_with_a_timeout_error(codec):
    clock = Clock()
    core = TokenizerCore(codec, DEFAULT_MAX_TOKENS, LIMITS, request_timeout=10.0, clock=clock)
    a = Peer(core, b"a")
    own = a.submitted("own", prompt="hi", stream=True, params={"timeout": 2.0})
    server = a.submitted("server", prompt="hi", stream=True)
    longer = a.submitted("longer", prompt="hi", params={"timeout": 60.0})   # capped at 10
    assert core.has_deadlines
    clock.now += 1.9
    assert core.expire() == [] and a.got == []
    clock.now += 0.2
    assert core.expire() == [Abort(own.rid)]
    [final] = a.got   # (take() would detach the sink the core holds)
    a.got.clear()
    assert final.rid == "own" and final.finish_reason == "error"
    assert final.error.startswith("timeout")
    clock.now += 8.0
    assert {a.rid for a in core.expire()} == {server.rid, longer.rid}
    assert {c.rid for c in a.take()} == {"server", "longer"}
    assert not core.has_deadlines and core.stats() == {"streams": 0}
    core.check_integrity()


def test_no_deadline_without_a_timeout(core):
    a = Peer(core, b"a")
    a.submitted("x", prompt="hi")
    assert not core.has_deadlines and core.expire() == []


# ---- n choices ----------------------------------------------------------------------

def test_n_choices_share_the_prompt_with_their_own_rids_and_seeds(core):
    a = Peer(core, b"a")
    reqs = a.submit("r", prompt="Hello", params={"n": 3, "temperature": 1.0, "seed": 7})
    assert len(reqs) == 3 and a.got == []
    assert len({r.rid for r in reqs}) == 3
    assert all(r.input_ids == reqs[0].input_ids for r in reqs)
    seeds = [r.sampling.seed for r in reqs]
    assert seeds[0] == 7 and len(set(seeds)) == 3
    again = Peer(core, b"b").submit("r", prompt="Hello",
                                    params={"n": 3, "temperature": 1.0, "seed": 7})
    assert [r.sampling.seed for r in again] == seeds   # seeded choices are reproducible
    unseeded = a.submit("u", prompt="Hello", params={"n": 2, "temperature": 1.0})
    assert [r.sampling.seed for r in unseeded] == [None, None]
    core.check_integrity()


def test_each_choice_streams_with_its_index_and_finishes_on_its_own(core, codec):
    a = Peer(core, b"a")
    reqs = a.submit("r", prompt="Hello", stream=True, params={"n": 2})
    ids = text_ids(codec, "the quick")
    usage = Usage(len(reqs[0].input_ids), 1, 0)
    core.on_batch(TokenBatch([entry(reqs[0].rid, ids[:1], "length", usage),
                              entry(reqs[1].rid, ids[:1])]))
    first, second = a.got
    assert (first.rid, first.index, first.finish_reason) == ("r", 0, "length")
    assert first.usage["completion_tokens"] == 1
    assert (second.rid, second.index, second.finish_reason) == ("r", 1, None)
    core.check_integrity()
    a.got.clear()
    assert a.rejected("r", prompt="Hi").code == "duplicate_rid"   # choice 1 still runs
    assert core.abort(b"a", "r") == [Abort(reqs[1].rid)]            # only what runs
    core.on_batch(TokenBatch([entry(reqs[1].rid, [], "abort", usage)]))
    assert a.got[-1].index == 1 and a.got[-1].finish_reason == "abort"
    assert core.stats() == {"streams": 0}
    core.check_integrity()
    assert len(a.submit("r", prompt="Hi")) == 1   # the rid is free again


def test_a_single_choice_has_index_0(core, codec):
    a = Peer(core, b"a")
    req = a.submitted("r", prompt="Hello", params={"n": 1})
    core.on_batch(TokenBatch([entry(req.rid, text_ids(codec, "the"), "stop")]))
    [chunk] = a.got
    assert chunk.index == 0 and chunk.to_wire()[8] == 0   # the wire field `index`


def test_aborting_forgetting_or_timing_out_a_request_ends_every_choice(codec):
    clock = Clock()
    core = TokenizerCore(codec, DEFAULT_MAX_TOKENS, LIMITS, clock=clock)
    a = Peer(core, b"a")
    aborted = a.submit("x", prompt="hi", params={"n": 3})
    assert core.abort(b"a", "x") == [Abort(r.rid) for r in aborted]
    forgotten = Peer(core, b"b").submit("y", prompt="hi", params={"n": 2})
    assert core.forget(b"b") == [Abort(r.rid) for r in forgotten]
    late = a.submit("z", prompt="hi", params={"n": 2, "timeout": 1.0})
    clock.now += 1.5
    assert core.expire() == [Abort(r.rid) for r in late]
    assert sorted(c.index for c in a.got) == [0, 1]
    assert all(c.finish_reason == "error" for c in a.got)
    core.check_integrity()


def test_an_abort_while_encoding_aborts_every_choice_once_admitted(core):
    a = Peer(core, b"a")
    pending = validated(core, a, prompt="Hello", params={"n": 2})
    assert core.abort(b"a", "r") == []
    first, second, *aborts = core.admit(pending)
    assert aborts == [Abort(first.rid), Abort(second.rid)]
    core.check_integrity()


@pytest.mark.parametrize("n", [0, 17, 1.0, "2"])
def test_n_out_of_range_is_refused(core, n):
    assert "n must be" in Peer(core, b"a").rejected(prompt="hi", params={"n": n}).message
