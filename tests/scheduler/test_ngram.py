"""Prompt-lookup drafts (NgramIndex) against a brute-force reference, and the
per-request draft length policy (DraftLength)."""

import random

import pytest

from mlxd.scheduler_proc.ngram import DraftLength, NgramIndex


def reference_propose(s: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The contract, by exhaustive search: the longest suffix with an earlier
    occurrence, continued from its most recent one, and read as a loop where the
    continuation reaches the end."""
    if k <= 0:
        return []
    length = len(s)
    for n in range(max_n, min_n - 1, -1):
        key = s[length - n:]
        for p in range(length - n - 1, -1, -1):   # p < length - n: strictly earlier
            if s[p:p + n] == key:
                loop = s[p + n:]
                return [loop[i % len(loop)] for i in range(k)]
    return []


# --- NgramIndex against the reference ---

@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 2), (2, 4), (3, 5), (2, 7)])
def test_matches_reference_on_random_sequences(min_n, max_n):
    rng = random.Random(f"{min_n}-{max_n}")
    for _ in range(60):
        alphabet = rng.randint(1, 4)
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(0, 6))]
        index = NgramIndex(seq, min_n=min_n, max_n=max_n)
        for _ in range(rng.randint(1, 15)):
            for k in (rng.randint(0, 8), 1, 50):
                assert index.propose(k) == reference_propose(seq, k, min_n, max_n), (seq, k)
            chunk = [rng.randrange(alphabet) for _ in range(rng.randint(0, 7))]
            index.extend(chunk)
            seq += chunk
            assert len(index) == len(seq)


def test_extend_accepts_any_iterable():
    index = NgramIndex([], min_n=1, max_n=2)
    index.extend(iter([1, 2, 3]))
    index.extend(t for t in (1, 2))
    assert len(index) == 5 and index.propose(3) == [3, 1, 2]


def test_the_index_owns_its_copy_of_the_prompt():
    prompt = [1, 2, 3, 1, 2]
    index = NgramIndex(prompt)
    prompt.clear()
    assert len(index) == 5 and index.propose(2) == [3, 1]


# --- NgramIndex edge cases ---

def test_empty_and_short_sequences_propose_nothing():
    assert NgramIndex([]).propose(4) == []
    assert NgramIndex([7]).propose(4) == []
    assert NgramIndex([7, 7]).propose(4) == []        # the only bigram is the suffix itself
    assert NgramIndex([7, 7], min_n=1).propose(4) == [7, 7, 7, 7]   # a loop of one token


def test_no_earlier_occurrence_proposes_nothing():
    assert NgramIndex([1, 2, 3, 4, 5, 6]).propose(4) == []
    assert NgramIndex([1, 2, 3, 1, 9]).propose(4) == []   # "1 9" never occurred before


def test_k_zero_or_negative_proposes_nothing():
    index = NgramIndex([1, 2, 1, 2, 1, 2])
    assert index.propose(0) == [] and index.propose(-3) == []


def test_a_repeated_token_continues_itself():
    index = NgramIndex([5, 5, 5, 5])
    # the 4-gram has no earlier occurrence; "5 5 5" at 0 continues with the last 5,
    # and the loop it ends in with more of it
    assert index.propose(3) == [5, 5, 5]
    index.extend([5] * 6)
    # the most recent earlier "5 5 5 5" ends one token before the end
    assert index.propose(3) == [5, 5, 5]


def test_the_continuation_may_overlap_the_suffix():
    index = NgramIndex([1, 2, 1, 2, 1, 2])
    # "1 2 1 2" occurred at 0: followed by s[4:] = "1 2", the suffix's own tokens,
    # then the loop again
    assert index.propose(5) == [1, 2, 1, 2, 1]
    assert index.propose(1) == [1]


def test_the_longest_suffix_wins_even_with_a_shorter_draft():
    seq = [8, 3, 4, 0, 0, 0, 9, 3, 4, 8, 3, 4]
    index = NgramIndex(seq, min_n=2, max_n=3)
    # "8 3 4" occurred at 0 (followed by 0 0 0 9 ...); "3 4" more recently at 7
    assert index.propose(3) == [0, 0, 0]
    short = NgramIndex([1, 2, 3, 9, 9, 9, 9, 2, 3, 5, 1, 2, 3], min_n=2, max_n=3)
    # "1 2 3" at 0 is chosen over the more recent "2 3" at 7
    assert short.propose(2) == [9, 9]


def test_the_most_recent_occurrence_wins():
    index = NgramIndex([1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2])
    assert index.propose(1) == [30]
    index.extend([40, 1, 2])
    assert index.propose(2) == [40, 1]


def test_a_draft_reaching_the_end_of_the_sequence_loops():
    index = NgramIndex([4, 5, 6, 4, 5])
    # "4 5" recurs 3 tokens after its earlier occurrence: the draft repeats those 3
    assert index.propose(7) == [6, 4, 5, 6, 4, 5, 6]
    assert NgramIndex([1, 2, 3, 4, 5, 9, 1, 2]).propose(3) == [3, 4, 5]   # no loop needed


@pytest.mark.parametrize("min_n,max_n", [(0, 2), (3, 2), (-1, 4)])
def test_bad_n_range_is_refused(min_n, max_n):
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex([1, 2, 3], min_n=min_n, max_n=max_n)


# --- NgramIndex cost ---

class ReadCounter:
    """Stands in for the index's token list: counts the tokens read and refuses to be
    iterated, so a propose that scanned the sequence would fail or show up here."""

    def __init__(self, tokens: list[int]):
        self._tokens = tokens
        self.read = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, key):
        out = self._tokens[key]
        self.read += len(out) if isinstance(key, slice) else 1
        return out

    def __iter__(self):
        raise AssertionError("propose iterated the sequence")


def test_propose_reads_only_the_suffix_and_the_draft():
    rng = random.Random(0)
    tokens = [rng.randrange(50) for _ in range(200_000)]
    index = NgramIndex(tokens, min_n=2, max_n=4)
    assert len(index) == 200_000
    counter = ReadCounter(index._tokens)
    index._tokens = counter     # propose only reads the sequence; it never appends
    k = 8
    for _ in range(10_000):
        before = counter.read
        draft = index.propose(k)
        assert counter.read - before <= (2 + 3 + 4) + k
        assert len(draft) <= k


def test_a_long_prompt_indexes_in_one_pass():
    index = NgramIndex(list(range(100)) * 1_000, min_n=2, max_n=4)   # 100k tokens
    assert index.propose(5) == [0, 1, 2, 3, 4]


# --- DraftLength ---

def test_starts_at_four_or_max_draft():
    assert DraftLength(8).length == 4 and DraftLength(8).next() == 4
    assert DraftLength(3).length == 3
    assert DraftLength(8, start=1).length == 1


def test_full_acceptance_doubles_up_to_max_draft():
    d = DraftLength(10, start=2)
    lengths = []
    for _ in range(4):
        n = d.next()
        d.record(n, n)
        lengths.append(d.length)
    assert lengths == [4, 8, 10, 10]


def test_partial_acceptance_shrinks_to_accepted_plus_one():
    d = DraftLength(8, start=8)
    d.record(8, 2)
    assert d.length == 3
    d.record(3, 2)
    assert d.length == 3
    d.record(3, 3)
    assert d.length == 6


def test_a_miss_drops_to_one_and_pauses_after_patience():
    d = DraftLength(8, patience=2)
    d.record(4, 0)
    assert d.length == 1 and not d.paused and d.next() == 1
    d.record(1, 0)
    assert d.paused
    assert [d.next() for _ in range(3)] == [0, 0, 1]    # the first pause is 2 steps


def test_pauses_double_up_to_max_pause_until_a_token_is_accepted():
    d = DraftLength(8, patience=1, max_pause=10)
    pauses = []
    for _ in range(5):
        d.record(d.length, 0)
        steps = 0
        while d.next() == 0:
            steps += 1
        pauses.append(steps)
    assert pauses == [2, 4, 8, 10, 10]
    d.record(1, 1)                                      # an accepted token resets growth
    assert d.length == 2
    d.record(2, 0)
    assert [d.next() for _ in range(3)] == [0, 0, 1]


def test_an_accepted_token_resets_the_misses():
    d = DraftLength(8, patience=2)
    d.record(4, 0)
    d.record(1, 1)
    d.record(2, 0)
    assert not d.paused                                 # misses were not in a row
    d.record(1, 0)
    assert d.paused


def test_max_pause_bounds_the_first_pause_and_zero_never_pauses():
    d = DraftLength(4, patience=1, max_pause=1)
    d.record(4, 0)
    assert [d.next() for _ in range(2)] == [0, 1]
    never = DraftLength(4, patience=1, max_pause=0)
    for _ in range(5):
        never.record(1, 0)
        assert never.next() == 1


def test_nothing_proposed_is_ignored():
    d = DraftLength(8, patience=1)
    for _ in range(5):
        d.record(0, 0)
    assert d.length == 4 and not d.paused and d.verifies == 0 and d.proposed_total == 0


def test_counters():
    d = DraftLength(8)
    d.record(4, 4)
    d.record(0, 0)
    d.record(8, 3)
    d.record(4, 0)
    assert (d.verifies, d.proposed_total, d.accepted_total) == (3, 16, 7)


@pytest.mark.parametrize("kwargs,match", [
    ({"max_draft": 0}, "max_draft"),
    ({"max_draft": 4, "start": 0}, "start"),
    ({"max_draft": 4, "start": 5}, "start"),
    ({"max_draft": 4, "patience": 0}, "patience"),
    ({"max_draft": 4, "max_pause": -1}, "max_pause"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DraftLength(**kwargs)


@pytest.mark.parametrize("proposed,accepted", [(2, 3), (-1, 0), (2, -1), (0, 1)])
def test_an_impossible_outcome_is_refused(proposed, accepted):
    with pytest.raises(ValueError, match="accepted"):
        DraftLength(4).record(proposed, accepted)
