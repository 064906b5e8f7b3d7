"""tokenizer_proc/request_stream.py: chunks, stop strings, logprobs and usage of one request."""

import random

import pytest

from mlxd.model_store.tiny import training_corpus
from mlxd.protocol import TokenEntry, Usage
from mlxd.tokenizer_proc.detokenizer import IncrementalDetokenizer
from mlxd.tokenizer_proc.request_stream import RequestStream
from tokenizer_support import decode, tokenizer  # noqa: F401  (fixtures)

RID = 7


@pytest.fixture(scope="module")
def encode(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def make_stream(decode, stop=(), stream=True, logprobs=False):
    return RequestStream("req-1", RID, IncrementalDetokenizer(decode), list(stop), stream,
                         logprobs)


def entries_for(ids, finish="length", sizes=None, tops=None, prompt_tokens=5, cached=0):
    """Scheduler-style entries: `sizes` tokens each; usage on the first, and with the
    finish reason on the last."""
    sizes = sizes or [1] * len(ids)
    out, i = [], 0
    for size in sizes:
        part = ids[i:i + size]
        top = None if tops is None else tops[i:i + size]
        out.append(TokenEntry(RID, part, [-0.5 - j for j in range(i, i + size)], top))
        i += size
    out[0].usage = Usage(prompt_tokens, len(out[0].token_ids), cached)
    out[-1].finish_reason = finish
    if finish:
        out[-1].usage = Usage(prompt_tokens, len(ids), cached)
    return out


def feed(rs, entries):
    """Feed entries until the stream finishes; return the chunks it produced."""
    chunks = []
    for entry in entries:
        assert not rs.finished
        chunk = rs.on_entry(entry)
        if chunk is not None:
            chunks.append(chunk)
        if rs.finished:
            break
    return chunks


def joined(chunks):
    return "".join(c.text for c in chunks)


# ---- streaming and non-streaming -----------------------------------------------------

@pytest.mark.parametrize("text", ["Hello world.", "日本語 😀 café", "The quick brown fox and a dog"])
def test_stream_chunks_concatenate_to_the_text(decode, encode, text):
    ids = encode(text)
    rs = make_stream(decode)
    chunks = feed(rs, entries_for(ids))
    assert joined(chunks) == text == rs.text
    assert [t for c in chunks for t in c.token_ids] == ids
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and rs.finished
    assert all(c.rid == "req-1" for c in chunks)
    assert all(c.logprobs is None and c.top_logprobs is None for c in chunks)


def test_stream_without_stop_strings_sends_text_immediately(decode, encode):
    ids = encode("Hello world. The end")
    rs = make_stream(decode)
    detok = IncrementalDetokenizer(decode)
    for entry in entries_for(ids, finish=None)[:-1]:
        chunk = rs.on_entry(entry)
        assert chunk is not None and chunk.text == detok.add(entry.token_ids)


def test_stream_random_group_sizes(decode, encode):
    rng = random.Random(3)
    for line in training_corpus(n_lines=40, seed=5) + ["Ünïcödé ½ € 日本語 😀 naïve café"]:
        ids = encode(line)
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(min(rng.randint(1, 4), len(ids) - sum(sizes)))
        chunks = feed(make_stream(decode), entries_for(ids, sizes=sizes))
        assert joined(chunks) == line
        assert [t for c in chunks for t in c.token_ids] == ids


def test_non_stream_sends_exactly_one_chunk_at_the_end(decode, encode):
    ids = encode("日本語 😀 café and more")
    rs = make_stream(decode, stream=False, logprobs=True)
    entries = entries_for(ids)
    results = [rs.on_entry(e) for e in entries]
    assert results[:-1] == [None] * (len(entries) - 1)
    chunk = results[-1]
    assert chunk.text == "日本語 😀 café and more" and chunk.token_ids == ids
    assert chunk.logprobs == [-0.5 - j for j in range(len(ids))]
    assert chunk.finish_reason == "length" and chunk.error is None
    assert chunk.usage == {"prompt_tokens": 5, "completion_tokens": len(ids),
                           "cached_tokens": 0, "disk_tokens": 0, "pinned_tokens": 0, "accepted_tokens": 0, "resumes": 0}


def test_entry_without_tokens_sends_nothing(decode, encode):
    rs = make_stream(decode)
    assert rs.on_entry(TokenEntry(RID, [], [])) is None
    assert rs.on_entry(TokenEntry(RID, encode("Hi"), [-1.0] * len(encode("Hi")))).text == "Hi"


def test_partial_character_sends_tokens_without_text(decode, encode):
    ids = encode("😀")
    assert len(ids) > 1
    rs = make_stream(decode)
    first = rs.on_entry(TokenEntry(RID, ids[:1], [-1.0]))
    assert first.text == "" and first.token_ids == ids[:1]
    rest = rs.on_entry(TokenEntry(RID, ids[1:], [-1.0] * (len(ids) - 1), finish_reason="length"))
    assert rest.text == "😀" and rest.token_ids == ids[1:]


def test_incomplete_character_is_flushed_at_the_end(decode, encode):
    ids = encode("ok 😀")[:-1]
    chunks = feed(make_stream(decode), entries_for(ids))
    assert joined(chunks) == decode(ids) and joined(chunks).startswith("ok ")


# ---- finish reasons, errors, usage ---------------------------------------------------

@pytest.mark.parametrize("reason", ["stop", "length", "abort", "error"])
def test_finish_reason_is_passed_on(decode, encode, reason):
    chunks = feed(make_stream(decode), entries_for(encode("Hello"), finish=reason))
    assert chunks[-1].finish_reason == reason


def test_abort_without_tokens(decode):
    rs = make_stream(decode)
    chunk = rs.on_entry(TokenEntry(RID, [], [], finish_reason="abort",
                                   usage=Usage(prompt_tokens=3, completion_tokens=0,
                                               cached_tokens=0)))
    assert rs.finished and chunk.finish_reason == "abort"
    assert chunk.text == "" and chunk.token_ids == []
    assert chunk.usage == {"prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0,
                           "disk_tokens": 0, "pinned_tokens": 0, "accepted_tokens": 0, "resumes": 0}


@pytest.mark.parametrize("stream", [True, False])
def test_error_is_passed_on(decode, encode, stream):
    rs = make_stream(decode, stream=stream)
    rs.on_entry(TokenEntry(RID, encode("Hi"), [-1.0] * len(encode("Hi"))))
    chunk = rs.on_entry(TokenEntry(RID, [], [], finish_reason="error", error="worker died",
                                   usage=Usage(prompt_tokens=5, completion_tokens=2,
                                               cached_tokens=0)))
    assert chunk.finish_reason == "error" and chunk.error == "worker died"
    assert chunk.text == ("" if stream else "Hi")


def test_usage(decode, encode):
    ids = encode("Hello world")
    rs = make_stream(decode)
    chunks = feed(rs, entries_for(ids, prompt_tokens=11, cached=4))
    assert chunks[-1].usage == {"prompt_tokens": 11, "completion_tokens": len(ids),
                                "cached_tokens": 4, "disk_tokens": 0, "pinned_tokens": 0,
                                "accepted_tokens": 0, "resumes": 0}
    assert rs.usage == Usage(prompt_tokens=11, completion_tokens=len(ids),
                             cached_tokens=4)   # remembered from the scheduler's usage


def test_a_scheduler_finish_passes_its_usage_on_as_it_is(decode, encode):
    """The scheduler counts; the tokenizer does not recount what it finished."""
    rs = make_stream(decode)
    rs.on_entry(TokenEntry(RID, encode("Hi"), [-1.0] * len(encode("Hi")),
                           usage=Usage(prompt_tokens=7, completion_tokens=1, cached_tokens=6)))
    final = Usage(prompt_tokens=7, completion_tokens=40, cached_tokens=6)
    chunk = rs.on_entry(TokenEntry(RID, [], [], finish_reason="abort", usage=final))
    assert chunk.usage == final.as_dict()


def test_a_finish_without_usage_has_none(decode):
    """The scheduler rejected the request before it ran: nothing was counted."""
    rs = make_stream(decode)
    chunk = rs.on_entry(TokenEntry(RID, [], [], finish_reason="error", error="too long"))
    assert rs.finished and chunk.usage is None


# ---- logprobs ------------------------------------------------------------------------

def test_logprobs_only_when_asked(decode, encode):
    ids = encode("Hello world")
    tops = [[[t, 1], [-0.5, -3.0]] for t in ids]
    for stream in (True, False):
        chunks = feed(make_stream(decode, stream=stream, logprobs=False),
                      entries_for(ids, tops=tops))
        assert all(c.logprobs is None and c.top_logprobs is None for c in chunks)


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_and_top_logprobs(decode, encode, stream):
    ids = encode("Hello world. The end")
    tops = [[[t, 1], [-0.5 - j, -9.0]] for j, t in enumerate(ids)]
    sizes = [2] * (len(ids) // 2) + [1] * (len(ids) % 2)
    chunks = feed(make_stream(decode, stream=stream, logprobs=True),
                  entries_for(ids, tops=tops, sizes=sizes))
    assert [x for c in chunks for x in c.logprobs] == [-0.5 - j for j in range(len(ids))]
    assert [x for c in chunks for x in c.top_logprobs] == tops
    for c in chunks:
        assert len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids)


def test_logprobs_without_top_logprobs(decode, encode):
    ids = encode("Hello world")
    chunks = feed(make_stream(decode, logprobs=True), entries_for(ids))
    assert [x for c in chunks for x in c.logprobs] == [-0.5 - j for j in range(len(ids))]
    assert all(c.top_logprobs is None for c in chunks)


# ---- stop strings --------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_stop_string_is_trimmed(decode, encode, stream):
    ids = encode("Hello world. The end of it")
    rs = make_stream(decode, stop=["The"], stream=stream)
    chunks = feed(rs, entries_for(ids, finish=None))
    assert rs.finished and rs.finish_reason == "stop"
    assert joined(chunks) == "Hello world. " == rs.text
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage["completion_tokens"] == len(rs.token_ids) < len(ids)
    assert chunks[-1].usage["prompt_tokens"] == 5
    if not stream:
        assert len(chunks) == 1


def test_stop_string_usage_is_the_schedulers_latest_with_the_tokens_passed_on(decode, encode):
    ids = encode("Hello world. The end of it")
    rs = make_stream(decode, stop=["The"])
    chunks = feed(rs, entries_for(ids, finish=None, prompt_tokens=9, cached=8))
    assert rs.finish_reason == "stop" and 1 < len(rs.token_ids) < len(ids)
    assert chunks[-1].usage == {"prompt_tokens": 9, "completion_tokens": len(rs.token_ids),
                                "cached_tokens": 8, "disk_tokens": 0, "pinned_tokens": 0,
                                "accepted_tokens": 0, "resumes": 0}


def test_stop_string_spanning_several_tokens(decode, encode):
    ids = encode("Hello world. The end")
    assert [decode([i]) for i in ids][:4] == ["H", "ello", " wor", "ld"]
    rs = make_stream(decode, stop=["llo wo"])
    chunks = feed(rs, entries_for(ids, finish=None))
    assert rs.finish_reason == "stop" and joined(chunks) == "He"
    assert len(rs.token_ids) == 3            # finished as soon as " wor" arrived


def test_stop_string_spanning_several_entries_of_byte_tokens(decode, encode):
    text = "日本語 😀 café"
    ids = encode(text)
    for stop in ["本語", "😀", "語 😀 c", "é"]:
        rs = make_stream(decode, stop=[stop])
        chunks = feed(rs, entries_for(ids, finish=None))
        assert rs.finish_reason == "stop", stop
        assert joined(chunks) == text[:text.index(stop)]


def test_text_that_could_start_a_stop_string_is_held_back(decode, encode):
    ids = encode("Hello world. The end")        # H | ello | " wor" | ld | ...
    rs = make_stream(decode, stop=["world"])
    texts = [rs.on_entry(TokenEntry(RID, [i], [-1.0])).text for i in ids[:3]]
    assert "".join(texts) == "Hello"             # " wor" is held back
    last = rs.on_entry(TokenEntry(RID, [ids[3]], [-1.0]))
    assert rs.finish_reason == "stop" and last.text == " "
    assert "".join(texts) + last.text == "Hello "


def test_held_back_text_is_released_when_it_is_not_a_stop_string(decode, encode):
    ids = encode("Hello world. The end")
    rs = make_stream(decode, stop=["world!"])
    streamed = ""
    for entry in entries_for(ids, finish=None)[:4]:
        streamed += rs.on_entry(entry).text
    assert streamed == "Hello "                  # "Hello world" minus 5 held characters
    streamed += rs.on_entry(TokenEntry(RID, encode("."), [-1.0])).text
    assert streamed == "Hello w"
    chunks = feed(rs, entries_for(encode(" The end"), finish="length"))
    assert streamed + joined(chunks) == "Hello world. The end"
    assert rs.finish_reason == "length"


def test_partial_stop_string_at_the_end_is_flushed(decode, encode):
    ids = encode("Hello wor")
    chunks = feed(make_stream(decode, stop=["world"]), entries_for(ids, finish="length"))
    assert joined(chunks) == "Hello wor" and chunks[-1].finish_reason == "length"


def test_stop_string_on_the_last_entry_overrides_length(decode, encode):
    ids = encode("Hello world")
    rs = make_stream(decode, stop=["world"])
    chunks = feed(rs, entries_for(ids, finish="length"))
    assert rs.finish_reason == "stop" and joined(chunks) == "Hello "


def test_stop_string_at_the_start(decode, encode):
    rs = make_stream(decode, stop=["Hel"])
    chunks = feed(rs, entries_for(encode("Hello world"), finish=None))
    assert rs.finish_reason == "stop" and joined(chunks) == ""


def test_earliest_stop_string_wins(decode, encode):
    ids = encode("Hello The world end")
    rs = make_stream(decode, stop=["end", "The", "world"], stream=False)
    chunk = rs.on_entry(TokenEntry(RID, ids, [-1.0] * len(ids)))
    assert rs.finish_reason == "stop" and chunk.text == "Hello "


def test_stop_string_found_in_one_big_entry(decode, encode):
    ids = encode("Hello world. The end")
    rs = make_stream(decode, stop=[". T"])
    chunk = rs.on_entry(TokenEntry(RID, ids, [-1.0] * len(ids)))
    assert rs.finish_reason == "stop" and chunk.text == "Hello world"


def check_stream_against_reference(decode, ids, stops, rng, stream=True):
    """Feed `ids` in random groups; compare with a reference of what text is known when."""
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(min(rng.randint(1, 3), len(ids) - sum(sizes)))
    entries = entries_for(ids, sizes=sizes, finish="length")
    # reference: the text known after each entry; the first that holds a stop string cuts
    detok, known, expected, reason = IncrementalDetokenizer(decode), "", None, "length"
    for entry in entries:
        known += detok.add(entry.token_ids)
        if entry.finish_reason:
            known += detok.flush()
        hits = [known.find(s) for s in stops if s in known]
        if hits:
            expected, reason = known[:min(hits)], "stop"
            break
    if expected is None:
        expected = known
    rs = make_stream(decode, stop=stops, stream=stream)
    streamed = ""
    holdback = max(len(s) for s in stops) - 1
    for entry in entries:
        chunk = rs.on_entry(entry)
        if chunk is not None:
            streamed += chunk.text
        assert expected.startswith(streamed)     # nothing past a stop string ever leaks
        if rs.finished:
            break
        if stream:                               # and not more is held than needed
            assert len(streamed) >= len(rs.text) - holdback
    assert rs.finished and rs.finish_reason == reason
    assert streamed == expected, (stops, expected, streamed)


@pytest.mark.parametrize("seed", range(6))
def test_random_stop_strings_against_a_reference(decode, encode, seed):
    rng = random.Random(seed)
    lines = training_corpus(n_lines=25, seed=seed) + ["Ünïcödé ½ € 日本語 😀 naïve café"]
    for line in lines:
        text = line + " " + rng.choice(lines)
        ids = encode(text)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 8)])
        if rng.random() < 0.3:
            stops = ["@@ never @@"] + stops[:1]
        check_stream_against_reference(decode, ids, stops, rng, stream=rng.random() < 0.8)


@pytest.mark.parametrize("seed", range(4))
def test_random_single_stop_string_cuts_at_its_first_occurrence(decode, encode, seed):
    rng = random.Random(100 + seed)
    for line in training_corpus(n_lines=30, seed=seed):
        ids = encode(line)
        start = rng.randrange(len(line))
        stop = line[start:start + rng.randint(1, 6)]
        rs = make_stream(decode, stop=[stop])
        chunks = feed(rs, entries_for(ids, finish="length"))
        assert rs.finish_reason == "stop"
        assert joined(chunks) == line[:line.index(stop)]


@pytest.mark.parametrize("finish", [None, "length"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_inside_a_run_of_tokens_keeps_only_the_tokens_up_to_it(
        decode, encode, finish, stream):
    """A verified draft brings several tokens in one entry: the stop string's cut
    counts only the tokens whose text reaches it (usage and token ids alike), as
    one token per entry would have."""
    ids = encode("alpha beta gamma delta epsilon zeta eta theta")
    stop = "delta"
    one_by_one = make_stream(decode, stop=[stop], stream=stream, logprobs=True)
    ones = feed(one_by_one, entries_for(ids, finish="length"))
    run = make_stream(decode, stop=[stop], stream=stream, logprobs=True)
    entries = entries_for(ids, finish=finish or "length", sizes=[2, len(ids) - 2])
    if finish is None:   # the run is not the request's last entry
        entries[-1].finish_reason, entries[-1].usage = None, None
    whole = feed(run, entries)
    assert run.finish_reason == one_by_one.finish_reason == "stop"
    assert joined(whole) == joined(ones) == "alpha beta gamma "
    assert run.token_ids == one_by_one.token_ids and len(run.token_ids) < len(ids)
    assert run.logprobs == one_by_one.logprobs
    assert whole[-1].usage["completion_tokens"] == len(run.token_ids)
    assert sum((c.token_ids for c in whole), []) == run.token_ids
