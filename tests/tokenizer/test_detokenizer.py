"""tokenizer_proc/detokenizer.py with a real byte-level BPE tokenizer."""

import random

import pytest

from mlxd.model_store.tiny import training_corpus
from mlxd.tokenizer_proc.detokenizer import REPLACEMENT, IncrementalDetokenizer
from tokenizer_support import decode, tokenizer  # noqa: F401  (fixtures)

TEXTS = [
    "Hello world.",
    "日本語 😀 café",
    "Ünïcödé ½ € 日本語 😀 naïve café",
    "The quick brown fox jumps over the lazy dog and then",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "😀😀😀🎉 emoji only",
    "中文 ß 한국어 Ωμέγα",
    "0123456789 + - * / = ( ) [ ] { }",
    "a",
    "é",
]


def stream(decode, ids, sizes=None):
    """The deltas of feeding `ids` in groups of `sizes` (default 1), then flush()."""
    detok = IncrementalDetokenizer(decode)
    deltas, i = [], 0
    for size in sizes or [1] * len(ids):
        deltas.append(detok.add(ids[i:i + size]))
        i += size
    assert i == len(ids)
    return deltas + [detok.flush()]


def random_sizes(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.choice([0, 1, 1, 2, 3, 5, 8]), n - sum(sizes)))
    return sizes


def check(decode, ids, deltas):
    full = decode(ids)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas), deltas
    text = ""
    for d in deltas:          # every prefix of the stream is a prefix of the full text
        text += d
        assert full.startswith(text)


def test_texts_are_split_into_byte_tokens(tokenizer):
    """The premise of the UTF-8 tests: these texts really split characters across tokens."""
    ids = tokenizer.encode("日本語 😀 café", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert sum(REPLACEMENT in p for p in pieces) >= 6


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tokenizer, decode, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert decode(ids) == text
    deltas = stream(decode, ids)
    check(decode, ids, deltas)
    assert deltas[-1] == ""     # complete text: nothing is left for flush()


@pytest.mark.parametrize("text", TEXTS)
def test_random_group_sizes(tokenizer, decode, text):
    ids = tokenizer.encode(text, add_special_tokens=True)   # with BOS, skipped in decode
    for seed in range(20):
        check(decode, ids, stream(decode, ids, random_sizes(random.Random(seed), len(ids))))


def test_all_at_once(tokenizer, decode):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert stream(decode, ids, [len(ids)]) == [text, ""]


def test_multi_byte_character_is_held_until_complete(tokenizer, decode):
    ids = tokenizer.encode("a日", add_special_tokens=False)
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "日"


def test_flush_releases_an_incomplete_character(tokenizer, decode):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]   # drop the last byte
    deltas = stream(decode, ids)
    assert "".join(deltas[:-1]) == "ok "
    assert deltas[-1] == decode(ids)[len("ok "):] and REPLACEMENT in deltas[-1]
    check(decode, ids, deltas)


def test_flush_twice_and_empty_adds(decode, tokenizer):
    detok = IncrementalDetokenizer(decode)
    assert detok.add([]) == "" and detok.flush() == ""
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    assert detok.add(ids) == "Hello"
    assert detok.add([]) == ""
    assert detok.flush() == "" and detok.flush() == ""
    assert detok.tokens == ids


def test_special_tokens_produce_no_text(tokenizer, decode):
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    ids = [1] + hello + [2, 5, 0] + hello + [2]
    deltas = stream(decode, ids)
    check(decode, ids, deltas)
    assert "".join(deltas) == "HelloHello"


def test_corpus_lines_in_random_groups(tokenizer, decode):
    rng = random.Random(7)
    lines = training_corpus(n_lines=60, seed=3)
    for line in lines:
        ids = tokenizer.encode(line, add_special_tokens=False)
        check(decode, ids, stream(decode, ids, random_sizes(rng, len(ids))))


@pytest.mark.parametrize("seed", range(8))
def test_random_token_ids(tokenizer, decode, seed):
    """Arbitrary ids, including lone UTF-8 continuation bytes and special tokens."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    for _ in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        check(decode, ids, stream(decode, ids))
        check(decode, ids, stream(decode, ids, random_sizes(rng, len(ids))))


def test_random_byte_tokens_of_multi_byte_text(tokenizer, decode):
    """Mix the byte-level tokens of CJK/emoji text in random order and groups."""
    rng = random.Random(11)
    pool = tokenizer.encode("日本語 😀 café 中文 ß 🎉 €½", add_special_tokens=False)
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 25))]
        check(decode, ids, stream(decode, ids, random_sizes(rng, len(ids))))


def test_decodes_only_a_short_window(tokenizer):
    """Each add() decodes recent tokens, not the whole history."""
    windows = []

    def decode(ids):
        windows.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode(" ".join(training_corpus(n_lines=30)), add_special_tokens=False)
    assert len(ids) > 200
    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert max(windows) <= 8
