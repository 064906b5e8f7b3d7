"""protocol/: every message round-trips, and every malformed frame is a ProtocolError."""

import math
import random

import msgpack
import pytest

from mlxd import protocol
from mlxd.protocol import (
    Abort, AbortRequest, Decoder, ErrorReply, GenerateRequest, GetStats, ModelControl,
    DecodeRow, EngineUnresponsive, ModelLoadFailed, Pin, PrefillInput,
    ProtocolError, Ready, SamplingParams, SchedulerReady, Stats, StatsReply, StatsRequest,
    Step, StepResult, StepTiming, StreamChunk, TokenBatch, TokenEntry, TokenizedRequest,
    Usage, WorkerError, WorkerLimits, WorkerReady, encode,
)
from mlxd.protocol.codec import MAX_FRAME_BYTES

TAGGED = [cls for cls in vars(protocol).values() if isinstance(cls, type) and hasattr(cls, "TAG")]

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**63 - 1,
                          top_logprobs=5)
PREFILL = PrefillInput(rid=3, input_ids=[5, 6, 7], prefix_slot_ids=[1, 2],
                       new_slot_ids=[10, 11, 12], sampling=SAMPLING, needs_logits=False)
RESUMED = PrefillInput(rid=4, input_ids=[5, 6, 7, 8, 9], prefix_slot_ids=[],
                       new_slot_ids=[20, 21, 22, 23, 24], sampling=SamplingParams(),
                       needs_logits=True, num_generated=2**40)
ENTRY = TokenEntry(rid=9, token_ids=[1, 2], logprobs=[-0.5, -1.25],
                   top_logprobs=[[[1, 4], [-0.5, -2.0]], None], finish_reason="length",
                   usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0),
                   error=None)
LIMITS = WorkerLimits(kv_capacity=4096, decode_cache_tokens=16384, max_context=2048,
                      vocab_size=32000, bytes_per_token=2**14, kv_pool_bytes=4097 * 2**14,
                      weights_bytes=2**28, buffer_cache_bytes=0, kv_dtype="mlx.core.float16",
                      device="Device(cpu, 0)", blas="/usr/lib/libopenblas.so.0",
                      quantized=True, dequantize=False, overlap=True, window_sizes=[512],
                      window_capacity=2048)
TIMING = StepTiming(compute_ms=12.25, wait_ms=0.5, idle_ms=0.0, chained_wait_ms=0.75,
                    chained=True, active_memory=2**33, peak_memory=2**34)

# Several instances per class: defaults, every optional field set, unicode, edge values.
SAMPLES = [
    Ready("scheduler"),
    Ready("tokenizer", "tcp://127.0.0.1:5555"),
    Ready("tokenizer", "tcp://127.0.0.1:5555", "http://127.0.0.1:8000"),
    WorkerReady(LIMITS),
    SchedulerReady(LIMITS, max_running_requests=64),
    SchedulerReady(LIMITS, max_running_requests=8, model="qwen"),
    ModelControl("load", "qwen"),
    ModelControl("unload", "qwen"),
    ModelLoadFailed("qwen", "its worker3 process exited with code 1: OSError: no weights"),
    EngineUnresponsive("engine1", 4242),
    SchedulerReady(LIMITS, max_running_requests=8, model="qwen", pid=77),
    TokenizedRequest(4, [1, 2], SamplingParams(seed=3), 9, [2], [], [5, 6], 1),
    GenerateRequest("r1"),
    GenerateRequest("r2", prompt="Hello, 日本語 😀", params={"temperature": 0.5, "stop": ["\n"]},
                    stream=True),
    GenerateRequest("r3", messages=[{"role": "user", "content": "hi"}]),
    GenerateRequest("", input_ids=[0, 1, 2**31]),
    AbortRequest("r1"),
    StatsRequest("s1"),
    StatsReply("s1", {"running": 2, "worker": {"kv_capacity": 4096}, "timing": {}}),
    GetStats(7),
    Stats(7, {"waiting": 0}),
    StreamChunk("r1", "", []),
    StreamChunk("r1", "text é", [1, 2], logprobs=[-0.1, -2], top_logprobs=[[[1], [-0.1]], None],
                finish_reason="stop", usage={"prompt_tokens": 1}, error="boom"),
    ErrorReply(None, "bad_request", "not a msgpack frame"),
    ErrorReply("r1", "invalid_request", "top_p must be in (0.0, 1.0]"),
    ErrorReply("r1", "invalid_request", "top_p must be in (0.0, 1.0]", "top_p"),
    TokenizedRequest(1, [1, 2, 3], SamplingParams(), 16),
    TokenizedRequest(2**40, [7], SAMPLING, 1, [2, 3]),
    TokenizedRequest(3, [1, 2, 3], SamplingParams(), 4, [], [Pin(2, 300), Pin(3, 3600)]),
    Abort(0),
    Abort(12345),
    TokenBatch([]),
    TokenBatch([TokenEntry(1, [], []), ENTRY,
                TokenEntry(2, [], [], finish_reason="error", error="the prompt is empty")]),
    TokenBatch([], cache_stored=[2**63 - 1], disk_reset=True, disk_stored=[5, 2**40],
               disk_removed=[7]),
    Step(1),
    Step(7, decodes=[DecodeRow(1, 30), DecodeRow(2, 31)], prefills=[PREFILL],
         releases=[4, 5]),
    Step(8, prefills=[PREFILL, RESUMED, PrefillInput(5, [1], [7], [8], SamplingParams())]),
    Step(9, decodes=[DecodeRow(1, 30, window=3)],
         prefills=[PrefillInput(5, [1, 2], [7], [8, 9], SamplingParams(),
                                prefix_window_ids=[4], new_window_ids=[0, 5])]),
    StepResult(1, [], [], []),
    StepResult(3, [1, 2], [5, 6, 7, 8], [-0.25, -1.0, -0.5, -3.5], runs=[3, 1]),
    Step(10, decodes=[DecodeRow(1, 30, draft=[5, 6], draft_slots=[32, 33]), DecodeRow(2, 31)],
         chain_next=False),
    Step(11, decodes=[DecodeRow(1, 30, window=3, draft_slots=[32, 33],
                                model_draft=2, chain_page=7), DecodeRow(2, 31, chain_page=0)]),
    StepResult(2, [1, 2], [5, 6], [-0.25, -3.5], top_logprobs=[None, [[6, 5], [-3.5, -4.0]]],
               timing=StepTiming(compute_ms=1.5)),
    StepResult(3, [4], [5], [-0.5], timing=TIMING),
    WorkerError(3, "RuntimeError: out of memory"),
]


def ids(values):
    return [type(v).__name__ for v in values]


def decode_as(cls, obj):
    """Decode a raw msgpack-able object with a Decoder that only knows `cls`."""
    return Decoder(cls).decode(msgpack.packb(obj, use_bin_type=True))


# ---- round trips ---------------------------------------------------------------------

@pytest.mark.parametrize("msg", SAMPLES, ids=ids(SAMPLES))
def test_round_trip(msg):
    assert Decoder(type(msg)).decode(encode(msg)) == msg


def test_every_tagged_class_has_a_sample_and_a_unique_tag():
    assert {type(m) for m in SAMPLES} == set(TAGGED)
    assert len({cls.TAG for cls in TAGGED}) == len(TAGGED)


def test_decoder_with_all_classes_round_trips_everything():
    decoder = Decoder(*TAGGED)
    for msg in SAMPLES:
        decoded = decoder.decode(encode(msg))
        assert type(decoded) is type(msg) and decoded == msg


NESTED = [SAMPLING, SamplingParams(), PREFILL, RESUMED, ENTRY, LIMITS, TIMING, StepTiming(),
          Usage(0, 0, 0), DecodeRow(1, 30), DecodeRow(1, 30, 3, [5], [32], 0, 9)]


@pytest.mark.parametrize("nested", NESTED, ids=ids(NESTED))
def test_nested_classes_round_trip_through_their_wire_form(nested):
    wire = msgpack.unpackb(msgpack.packb(nested.to_wire(), use_bin_type=True), raw=False)
    assert type(nested).from_wire(wire) == nested


def test_int_fields_accept_ints_for_float_fields():
    msg = decode_as(TokenizedRequest,
                    [30, 1, [1], [1, 1, 0, 0, None, 0, 0, 0, 1, [], [], 0, None, None, [], [], False], 4, [], [],
                     [], 0])
    assert msg.sampling.temperature == 1.0 and type(msg.sampling.temperature) is float
    assert msg.sampling.greedy is False


# ---- the decoder's own checks --------------------------------------------------------

@pytest.mark.parametrize("msg", SAMPLES, ids=ids(SAMPLES))
def test_decoder_rejects_tags_it_was_not_given(msg):
    others = [cls for cls in TAGGED if cls is not type(msg)]
    with pytest.raises(ProtocolError, match="tag"):
        Decoder(*others).decode(encode(msg))


def test_empty_decoder_rejects_everything():
    for msg in SAMPLES:
        with pytest.raises(ProtocolError):
            Decoder().decode(encode(msg))


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x92", b"\xdc\xff\xff", b"\xd9\x05ab", b"\xa2\xff\xfe",
    encode(Abort(1)) + b"\x00",            # trailing bytes after a valid frame
    encode(Step(1, [DecodeRow(1, 2)]))[:-1],   # truncated frame
], ids=["empty", "never-used-byte", "short-array", "truncated-array16", "truncated-str",
        "invalid-utf8", "extra-data", "truncated-frame"])
def test_garbage_bytes(frame):
    with pytest.raises(ProtocolError):
        Decoder(*TAGGED).decode(frame)


@pytest.mark.parametrize("obj", [
    5, "abc", None, True, 1.5, b"\x1f", {"tag": 31}, {31: [1]}, [], ["31", 1], [31.0, 1],
    [True, 1], [None], [[31], 1], [-1], [2**64 - 1], [1000],
], ids=repr)
def test_non_message_frames(obj):
    with pytest.raises(ProtocolError):
        Decoder(*TAGGED).decode(msgpack.packb(obj, use_bin_type=True))


def test_unhashable_map_key_is_a_protocol_error():
    # msgpack raises TypeError for a map keyed by an array; the decoder must wrap it.
    frame = b"\x92\x01\x81\x91\x01\x01"    # [1, {[1]: 1}]
    with pytest.raises(ProtocolError):
        Decoder(Ready).decode(frame)


def test_oversized_frame():
    frame = msgpack.packb([31, 1]) + b"\x00" * (MAX_FRAME_BYTES)
    with pytest.raises(ProtocolError, match="exceeds"):
        Decoder(Abort).decode(frame)


def test_random_bytes_never_raise_anything_but_protocol_error():
    decoder = Decoder(*TAGGED)
    rng = random.Random(1234)
    for _ in range(3000):
        frame = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        try:
            decoder.decode(frame)
        except ProtocolError:
            pass


def test_mutated_valid_frames_never_raise_anything_but_protocol_error():
    decoder = Decoder(*TAGGED)
    rng = random.Random(99)
    frames = [encode(m) for m in SAMPLES]
    for _ in range(6000):
        frame = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(3)
            pos = rng.randrange(len(frame))
            if op == 0:
                frame[pos] = rng.randrange(256)
            elif op == 1:
                del frame[pos]
            else:
                frame.insert(pos, rng.randrange(256))
        try:
            decoder.decode(bytes(frame))
        except ProtocolError:
            pass


# ---- field counts and field types ----------------------------------------------------

@pytest.mark.parametrize("msg", SAMPLES, ids=ids(SAMPLES))
def test_wrong_field_counts(msg):
    wire = [msg.TAG, *msg.to_wire()]
    for bad in (wire[:-1], wire + [None], wire + [0, 0], wire[:1]):
        with pytest.raises(ProtocolError):
            decode_as(type(msg), bad)


def good_sampling():
    return [0.5, 0.9, 10, 0.1, 42, 2, 0.0, 0.0, 1.0, [], [], 0, None, None, [], [], False]


def good_prefill():
    return [3, [5, 6], [], [10, 11], good_sampling(), True, 0, [], [], [], 0, 0, 0, [], [],
            [], 0, 0, 0]


def wire_row(rid, slot, window=0, draft=(), slots=(), model_draft=0, page=0):
    """A DecodeRow's wire fields: rid, slot, window, draft, draft_slots, model_draft,
    chain_page."""
    return [rid, slot, window, list(draft), list(slots), model_draft, page]


def good_row():
    return wire_row(1, 2)


def good_step(decodes=(), prefills=(), chain_next=True) -> list:
    """A Step's fields: step_id, decodes, prefills, releases, spills, chain_next."""
    return [1, list(decodes), list(prefills), [], [], chain_next]


def good_entry():
    return [9, [1], [-0.5], None, None, None, None]


def good_batch() -> list:
    """A TokenBatch's fields: one entry, no cache or disk events."""
    return [[good_entry()], False, [], [], False, [], []]


def good_timing():
    return [1.5, None, None, 0.0, False, 0, 0]


def replace(values, index, value):
    values = list(values)
    values[index] = value
    return values


# (class, good wire fields, index, bad value)
WRONG_TYPES = [
    (Ready, ["tokenizer", "tcp://h:1", "http://h:2", "tcp://h:3"], 0, 5),
    (Ready, ["tokenizer", "tcp://h:1", "http://h:2", "tcp://h:3"], 0, None),
    (Ready, ["tokenizer", "tcp://h:1", "http://h:2", "tcp://h:3"], 1, [1, 2]),
    (Ready, ["tokenizer", "tcp://h:1", "http://h:2", "tcp://h:3"], 1, {"address": "tcp://h:1"}),
    (Ready, ["tokenizer", "tcp://h:1", "http://h:2", "tcp://h:3"], 2, 8000),
    (Ready, ["tokenizer", "tcp://h:1", "http://h:2", "tcp://h:3"], 3, 8200),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 1, 0),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 1, None),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 0, LIMITS.as_dict()),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 2, None),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 2, "m" * 257),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 3, -1),
    (SchedulerReady, [LIMITS.to_wire(), 64, "", 0], 3, None),
    (ModelControl, ["load", "m"], 0, "reload"),
    (GenerateRequest, ["r", "hi", None, None, {}, False, "", None], 7, 5),
    (GenerateRequest, ["r", "p", None, None, {}, False, "", None], 1, 5),
    (GenerateRequest, ["r", None, [{"role": "user"}], None, {}, False, "", None], 2, {"role": "user"}),
    (GenerateRequest, ["r", None, None, [1, 2], {}, False, "", None], 3, "1 2"),
    (GenerateRequest, ["r", None, None, [1, 2], {}, False, "", None], 3, [1, "2"]),
    (GenerateRequest, ["r", None, None, [1, 2], {}, False, "", None], 3, [1, 2.0]),
    (GenerateRequest, ["r", None, None, [1, 2], {}, False, "", None], 3, [True, 2]),
    (GenerateRequest, ["r", "p", None, None, {}, False, "", None], 4, None),
    (GenerateRequest, ["r", "p", None, None, {}, False, "", None], 4, [["temperature", 1]]),
    (GenerateRequest, ["r", "p", None, None, {}, False, "", None], 5, 0),
    (GenerateRequest, ["r", "p", None, None, {}, False, "", None], 5, None),
    (AbortRequest, ["r", ""], 0, 1),
    (AbortRequest, ["r", ""], 0, b"r"),
    (AbortRequest, ["r", ""], 1, 5),
    (GenerateRequest, ["r", "p", None, None, {}, False, "", None], 6, None),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 0, None),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 1, None),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 1, b"t"),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 2, [1.0]),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 3, ["x"]),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 3, [True]),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 4, {"a": 1}),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 5, 1),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 6, []),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 7, False),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 8, -1),
    (StreamChunk, ["r", "t", [1], None, None, None, None, None, 0, None, None], 8, None),
    (ErrorReply, ["r", "code", "msg", None], 0, 3),
    (ErrorReply, ["r", "code", "msg", None], 1, None),
    (ErrorReply, ["r", "code", "msg", None], 2, None),
    (ErrorReply, ["r", "code", "msg", "top_p"], 3, 5),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 0, "1"),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 0, True),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 0, 1.0),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 1, "abc"),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 1, [1, None]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 1, None),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 2, None),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 2, {"temperature": 0}),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 2, good_sampling()[:5]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 3, 0),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 3, -1),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 3, True),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 3, 4.0),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 4, None),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 4, [False]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, None),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, [[1]]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, [[0, 300]]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, [[1, 0]]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, [["1", 300]]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, [[1, 300.0]]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 5, [[1, 300]] * 5),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 6, None),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 6, [None]),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 7, -1),
    (TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 7, None),
    (Abort, [1], 0, "1"),
    (Abort, [1], 0, False),
    (Abort, [1], 0, None),
    (TokenBatch, good_batch(), 0, None),
    (TokenBatch, good_batch(), 0, {"entries": []}),
    (TokenBatch, good_batch(), 0, [5]),
    (TokenBatch, good_batch(), 0, [good_entry()[:6]]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 0, "9")]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 1, [1.5])]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 2, ["x"])]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 3, 3)]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 4, "done")]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 4, 1)]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 5, [1])]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 5, {"prompt_tokens": 1})]),
    (TokenBatch, good_batch(), 0, [replace(good_entry(), 6, 0)]),
    (TokenBatch, good_batch(), 1, 0),
    (TokenBatch, good_batch(), 2, [1.5]),
    (TokenBatch, good_batch(), 3, ["x"]),
    (Step, good_step([good_row()]), 0, "1"),
    # a row's chain_page: one page id (>= 0) per decode row
    (Step, good_step([good_row()]), 1, [replace(good_row(), 6, -1)]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 6, "3")]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 6, [3])]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 6, [1, 2])]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 6, None)]),
    (Step, good_step([good_row()]), 0, None),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 0, True)]),
    (Step, good_step([good_row()]), 1, "1"),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 1, 2.0)]),
    (Step, good_step([good_row()]), 2, None),
    (Step, good_step([good_row()]), 2, [None]),
    (Step, good_step([good_row()]), 2, [good_prefill()[:6]]),        # the old 6-field form
    (Step, good_step([good_row()]), 2, [good_prefill() + [0]]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 0, "3")]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 1, "ab")]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 2, None)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 3, [10, "11"])]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 4, None)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 5, 1)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 5, None)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 6, -1)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 6, 1.0)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 6, True)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 6, None)]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 6, "2")]),
    (Step, good_step([good_row()]), 2, [replace(good_prefill(), 6, [2])]),
    (Step, good_step([good_row()]), 3, None),
    (Step, good_step([good_row()]), 3, [1.0]),
    # a DecodeRow's other fields, and rows of the wrong shape
    (Step, good_step([good_row()]), 1, [good_row()[:6]]),
    (Step, good_step([good_row()]), 1, [good_row() + [0]]),
    (Step, good_step([good_row()]), 1, [None]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 1, None)]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 2, -1)]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 2, [3])]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 3, [1.5])]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 3, 5)]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 4, None)]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 5, -1)]),
    (Step, good_step([good_row()]), 1, [replace(good_row(), 5, True)]),
    (Step, good_step([good_row()]), 4, None),
    (Step, good_step([good_row()]), 5, None),
    (Step, good_step([good_row()]), 5, 1),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 0, 1.0),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 1, "1"),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 1, [None]),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 2, [2.0]),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 2, [False]),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 3, ["-0.5"]),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 3, [None]),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 3, -0.5),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 4, {"a": 1}),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 5, None),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 5, []),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 5, {}),
    (StepResult, [1, [1], [2], [-0.5], None, good_timing(), [], [], []], 5, good_timing()[:6]),
    (WorkerError, [1, "m"], 0, "1"),
    (WorkerError, [1, "m"], 1, None),
    (WorkerError, [1, "m"], 1, 7),
]

SAMPLING_FIELD_BAD = [(0, "0.5"), (0, None), (0, True), (1, None), (1, [1.0]), (2, 1.5),
                      (2, "10"), (2, True), (2, None), (3, None), (4, 1.5), (4, "42"),
                      (4, True), (5, 1.0), (5, None), (5, True), (12, 7), (12, ["g"])]
WRONG_TYPES += [(TokenizedRequest, [1, [1], good_sampling(), 4, [], [], [], 0], 2,
                 replace(good_sampling(), i, v)) for i, v in SAMPLING_FIELD_BAD]
WRONG_TYPES += [(Step, good_step(prefills=[good_prefill()]), 2,
                 [replace(good_prefill(), 4, replace(good_sampling(), i, v))])
                for i, v in SAMPLING_FIELD_BAD]
# the worker's step timing: figures of the wrong type are refused, not left out
TIMING_FIELD_BAD = [(0, "fast"), (0, None), (1, True), (1, "1"), (2, [0.5]), (3, None),
                    (4, 1), (4, None), (5, -1), (5, 1.5), (6, None)]
WRONG_TYPES += [(StepResult, [1, [], [], [], None, good_timing(), [], [], []], 5,
                 replace(good_timing(), i, v)) for i, v in TIMING_FIELD_BAD]
# limits the scheduler and tokenizer size everything by: counts of at least 1 (KV bytes
# per token and state slots may be 0: a model without attention or without state)
LIMITS_FIELD_BAD = [(0, 0), (0, -5), (0, "many"), (0, None), (1, -1), (2, 0), (2, 4096.0),
                    (3, 0), (4, -1), (5, 0), (6, -1), (7, -1), (8, None), (9, 1), (10, None),
                    (11, 1), (12, "on"), (13, None), (14, -1), (15, -1), (16, -1), (17, [0]),
                    (17, None)]
WRONG_TYPES += [(WorkerReady, [LIMITS.to_wire()], 0, replace(LIMITS.to_wire(), i, v))
                for i, v in LIMITS_FIELD_BAD]
WRONG_TYPES += [(TokenBatch, good_batch(), 0, [replace(good_entry(), 5, usage)])
                for usage in ([1, 0], [1, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, -1], [1, 0, 0, -1], [-1, 0, 0], [1, 0.5, 0],
                              [1, 0, None],
                              {"prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0})]


@pytest.mark.parametrize("cls,good,index,bad", WRONG_TYPES,
                         ids=[f"{c.__name__}[{i}]={b!r}"[:70] for c, _, i, b in WRONG_TYPES])
def test_wrong_field_types(cls, good, index, bad):
    decode_as(cls, [cls.TAG, *good])          # the unmodified frame is valid
    with pytest.raises(ProtocolError):
        decode_as(cls, [cls.TAG, *replace(good, index, bad)])


# ---- cross-field checks --------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    [1, [1, 2], [5], [-0.5, -0.5], None, good_timing(), [], [], []],
    [1, [1, 2], [5, 6], [-0.5], None, good_timing(), [], [], []],
    [1, [1], [5, 6], [-0.5, -0.5], None, good_timing(), [], [], []],
    [1, [1, 2], [5, 6], [-0.5, -0.5], [None], good_timing(), [], [], []],
    [1, [1], [5], [-0.5], [None, None], good_timing(), [], [], []],
    [1, [], [], [], [None], good_timing(), [], [], []],
    [1, [], [5], [], None, good_timing(), [], [], []],
    [1, [1, 2], [5, 6, 7], [-0.5] * 3, None, good_timing(), [1, 1], [], []],   # runs: 2 tokens
    [1, [1, 2], [5, 6, 7], [-0.5] * 3, None, good_timing(), [3], [], []],      # runs: 1 row
])
def test_misaligned_step_result(fields):
    with pytest.raises(ProtocolError, match="aligned"):
        decode_as(StepResult, [StepResult.TAG, *fields])


@pytest.mark.parametrize("drafts,slots", [
    ([5], []),            # a draft without its slot
    ([5], [9, 10]),       # more slots than drafts
    ([5, 6], [9]),        # fewer slots than drafts
    ([], [9]),            # slots without drafts
])
def test_drafts_must_align_with_their_slots(drafts, slots):
    """Each row's draft and draft_slots, one for one (and draft window ids with the
    slots: test_draft_window_ids_align_with_slots). Rows can no longer disagree with
    one another in count: each row carries its own."""
    with pytest.raises(ProtocolError, match="draft"):
        decode_as(Step, [Step.TAG, *good_step([wire_row(1, 2, draft=drafts, slots=slots)],
                                              chain_next=False)])


@pytest.mark.parametrize("rows", [
    [wire_row(1, 2, slots=[9], model_draft=2), wire_row(2, 3)],   # a count without as many slots
    [wire_row(1, 2, slots=[9, 10], model_draft=2),
     wire_row(2, 3, model_draft=1)],                               # each row's count its slots
    [wire_row(1, 2, draft=[5], slots=[9], model_draft=1),
     wire_row(2, 3)],                                              # drafts from both sides
    [wire_row(1, 2, model_draft=1), wire_row(2, 3)],               # a count without slots
])
def test_model_drafts_align_with_their_slots(rows):
    with pytest.raises(ProtocolError, match="draft"):
        decode_as(Step, [Step.TAG, *good_step(rows, chain_next=False)])


def test_model_drafts_with_their_slots_are_accepted():
    step = decode_as(Step, [Step.TAG, *good_step(
        [wire_row(1, 2, slots=[9, 10], model_draft=2), wire_row(2, 3)], chain_next=False)])
    assert step.has_drafts and [row.model_draft for row in step.decodes] == [2, 0]
    assert [row.drafts for row in step.decodes] == [True, False]
    assert step.decode_rids == [1, 2]


def test_aligned_step_result_with_top_logprobs_is_accepted():
    msg = decode_as(StepResult, [60, 4, [1, 2], [5, 6], [-1, -2.5], [None, [[6], [-2.5]]],
                                 good_timing(), [], [], []])
    assert msg.logprobs == [-1, -2.5] and msg.top_logprobs[0] is None


@pytest.mark.parametrize("input_ids,new_slot_ids", [
    ([5, 6], [10]), ([5], [10, 11]), ([], []), ([5, 6], []), ([], [10]),
])
def test_prefill_lengths_must_match(input_ids, new_slot_ids):
    prefill = [3, input_ids, [], new_slot_ids, good_sampling(), True, 0, [], [], [], 0, 0, 0,
               [], [], [], 0, 0, 0]
    with pytest.raises(ProtocolError, match="equal length"):
        decode_as(Step, [Step.TAG, *good_step(prefills=[prefill])])


@pytest.mark.parametrize("prefix_windows,new_windows", [
    ([], [1]), ([4], [1]), ([], [1, 2, 3]), ([4, 5], [1, 2]),
])
def test_prefill_window_ids_must_match_slot_ids(prefix_windows, new_windows):
    prefill = [3, [5, 6], [9], [10, 11], good_sampling(), True, 0, [], [], [], 0, 0, 0,
               prefix_windows, new_windows, [], 0, 0, 0]
    with pytest.raises(ProtocolError, match="window ids"):
        decode_as(Step, [Step.TAG, *good_step(prefills=[prefill])])


def test_a_decode_rows_window_is_one_window_id():
    """(Each row carries its own window id, so rows and window ids can no longer
    differ in count; what is left to check is each row's: one id, >= 0.)"""
    step = decode_as(Step, [Step.TAG, *good_step([wire_row(1, 5, 7), wire_row(2, 6)])])
    assert [row.window for row in step.decodes] == [7, 0]
    with pytest.raises(ProtocolError, match="window"):
        decode_as(Step, [Step.TAG, *good_step([wire_row(1, 5, 7), wire_row(2, 6, -1)])])
    with pytest.raises(ProtocolError, match="window"):
        decode_as(Step, [Step.TAG, *good_step([wire_row(1, 5, [7]), wire_row(2, 6)])])


@pytest.mark.parametrize("num_generated", [0, 1, 7, 2**31, 2**63 - 1])
def test_prefill_num_generated_in_range_is_accepted(num_generated):
    prefill = replace(good_prefill(), 6, num_generated)
    step = decode_as(Step, [Step.TAG, *good_step(prefills=[prefill])])
    assert step.prefills[0].num_generated == num_generated
    assert step.prefills[0].to_wire() == prefill


def test_prefill_num_generated_defaults_to_zero_followed_by_the_sampling_context():
    p = PrefillInput(3, [5], [], [10], SamplingParams())
    assert p.num_generated == 0 and p.needs_logits is True
    assert p.to_wire()[6] == 0 and p.to_wire()[7:] == [[], [], [], 0, 0, 0, [], [], [], 0, 0, 0]
    assert RESUMED.to_wire()[6] == 2**40


@pytest.mark.parametrize("num_generated", [-1, -2**40])
def test_prefill_negative_num_generated_is_rejected(num_generated):
    prefill = replace(good_prefill(), 6, num_generated)
    with pytest.raises(ProtocolError, match="num_generated"):
        decode_as(Step, [Step.TAG, *good_step(prefills=[prefill])])


def test_step_decode_rows_need_a_rid_and_a_slot():
    """(Rids and slots are one record per row now, so they cannot differ in count;
    a row missing its slot or its rid is what remains to refuse.)"""
    with pytest.raises(ProtocolError):
        decode_as(Step, [Step.TAG, *good_step([wire_row(1, 10), wire_row(2, 11)[:1]])])
    with pytest.raises(ProtocolError):
        decode_as(Step, [Step.TAG, *good_step([wire_row(1, 10)[1:]])])
    with pytest.raises(ProtocolError):
        decode_as(Step, [Step.TAG, *good_step([wire_row(1, None)])])
    with pytest.raises(ProtocolError):
        decode_as(Step, [Step.TAG, *good_step([wire_row(None, 10)])])
    step = decode_as(Step, [Step.TAG, *good_step([wire_row(1, 10), wire_row(2, 11)])])
    assert step.decode_rids == [1, 2] and [row.slot for row in step.decodes] == [10, 11]


def test_unknown_finish_reason():
    for reason in ("stop", "length", "abort", "error"):
        decode_as(TokenBatch, [40, [replace(good_entry(), 4, reason)], *good_batch()[1:]])
    with pytest.raises(ProtocolError, match="finish_reason"):
        decode_as(TokenBatch, [40, [replace(good_entry(), 4, "eos")], *good_batch()[1:]])


@pytest.mark.parametrize("index,value", [
    (0, -0.01), (0, -1), (0, math.nan), (0, math.inf), (0, -math.inf),
    (1, 0), (1, 0.0), (1, -0.5), (1, 1.0001), (1, 2), (1, math.nan), (1, math.inf),
    (2, -1), (3, -0.1), (3, 1.5), (3, math.nan), (5, -1),
], ids=lambda v: repr(v))
def test_out_of_range_sampling_params(index, value):
    with pytest.raises(ProtocolError):
        decode_as(TokenizedRequest,
                  [30, 1, [1], replace(good_sampling(), index, value), 4, [], []])
    prefill = replace(good_prefill(), 4, replace(good_sampling(), index, value))
    with pytest.raises(ProtocolError):
        decode_as(Step, [Step.TAG, *good_step(prefills=[prefill])])


@pytest.mark.parametrize("index,value", [
    (0, 0), (0, 0.0), (0, 100.0), (1, 1), (1, 1e-9), (2, 0), (2, 10**6), (3, 0), (3, 1),
    (4, None), (4, 0), (4, -5), (5, 0), (5, 20), (12, None), (12, "start: /a+/"),
], ids=lambda v: repr(v))
def test_in_range_sampling_params_are_accepted(index, value):
    msg = decode_as(TokenizedRequest,
                    [30, 1, [1], replace(good_sampling(), index, value), 4, [], [], [], 0])
    assert msg.sampling.to_wire()[index] == value
    prefill = replace(good_prefill(), 4, replace(good_sampling(), index, value))
    step = decode_as(Step, [Step.TAG, *good_step(prefills=[prefill])])
    assert step.prefills[0].sampling.to_wire()[index] == value


# ---- GenerateRequest errors carry the rid ---------------------------------------------

@pytest.mark.parametrize("fields", [
    ["abc"],
    ["abc", "p", None, None, {}],
    ["abc", "p", None, None, {}, False, None],
    ["abc", 5, None, None, {}, False],
    ["abc", None, "not a list", None, {}, False],
    ["abc", None, None, ["x"], {}, False],
    ["abc", None, None, None, [], False],
    ["abc", "p", None, None, {}, "yes"],
])
def test_generate_request_error_carries_rid(fields):
    with pytest.raises(ProtocolError) as info:
        decode_as(GenerateRequest, [GenerateRequest.TAG, *fields])
    assert info.value.rid == "abc"


@pytest.mark.parametrize("fields", [[], [5, "p", None, None, {}, False, ""], [None], [b"abc"]])
def test_generate_request_error_without_readable_rid(fields):
    with pytest.raises(ProtocolError) as info:
        decode_as(GenerateRequest, [GenerateRequest.TAG, *fields])
    assert info.value.rid is None


def test_protocol_error_is_a_value_error_and_rid_defaults_to_none():
    with pytest.raises(ValueError) as info:
        Decoder(Abort).decode(b"\xc1")
    assert isinstance(info.value, ProtocolError) and info.value.rid is None
