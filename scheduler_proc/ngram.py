"""Speculative-decoding drafts by prompt lookup, and how long to make them.

A request that repeats itself (code edits, quoting its prompt, lists) can be
drafted for free: find the latest earlier place where the sequence's last few
tokens occurred and propose the tokens that followed them there. `NgramIndex`
answers that in time independent of the sequence's length; `DraftLength`
chooses, from the request's recent acceptance, how many tokens to ask it for.
Both are per request and pure (no MLX, no I/O).
"""

from collections.abc import Iterable, Sequence


class NgramIndex:
    """Suffix index over one request's tokens (prompt, then its output as it grows).

    For each n in min_n..max_n a dict maps an n-gram to the position right after
    its most recent occurrence that has a continuation. An n-gram is entered only
    when the token after it arrives, so the sequence's own suffix never maps to
    itself. Memory is O(len * (max_n - min_n + 1)) entries.
    """

    def __init__(self, tokens: Sequence[int], min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        """Tokens indexed."""
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the sequence, O(max_n) dict updates each."""
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        # the n-grams ending just before `token` now have a continuation: `token`
        end = len(self._tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._after[n][tuple(self._tokens[end - n:end])] = end
        self._tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the longest suffix of the sequence (n from max_n
        down to min_n) that occurred earlier: the tokens that followed its most recent
        earlier occurrence. [] when no suffix of length >= min_n occurred before, or
        k <= 0. Cost O(max_n + k), never O(len).

        Where the continuation runs into the end of the sequence, the sequence is
        read as repeating from there: the suffix recurs `length - start` tokens after
        its earlier occurrence, so the draft cycles through the tokens between (a
        loop such as "a b a b" continues "a b a b ...", not only "a b").
        """
        if k <= 0:
            return []
        length = len(self._tokens)
        start = self._continuation(length)
        if start is None:
            return []
        draft = self._tokens[start:start + k]
        period = length - start
        while len(draft) < k:
            draft.append(self._tokens[start + len(draft) % period])
        return draft

    def _continuation(self, length: int) -> int | None:
        """Where the continuation of the longest earlier-seen suffix starts, if any."""
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._after[n].get(tuple(self._tokens[length - n:length]))
            if start is not None:
                return start
        return None


FIRST_PAUSE = 2


class DraftLength:
    """How many tokens to draft for one request next, from its recent acceptance.

    Policy, one verify step at a time (`record`):
      - the length starts at `start` (default min(4, max_draft));
      - the whole draft accepted: the length doubles, capped at max_draft;
      - part of it accepted: the length becomes accepted + 1 (the tokens that
        would have been accepted, plus one to probe further), capped at max_draft;
      - none accepted: the length drops to 1, and after `patience` such verifies in
        a row drafting pauses: `next` returns 0 for the next `pause` steps. The
        first pause lasts 2 steps (or max_pause, if smaller); each pause that
        follows without an accepted token in between lasts twice the last one,
        capped at max_pause. A pause resets the count of misses.
      - any accepted token resets both the misses and the pause growth.
    Nothing proposed (`record(0, 0)`, e.g. no n-gram matched) is not a verify and
    changes nothing. max_pause=0 never pauses.

    Counters: `proposed_total` and `accepted_total` draft tokens, and `verifies`
    (the record calls with something proposed).
    """

    def __init__(self, max_draft: int, start: int | None = None, patience: int = 2,
                 max_pause: int = 32):
        start = min(4, max_draft) if start is None else start
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        if not 1 <= start <= max_draft:
            raise ValueError(f"start must be in 1..max_draft={max_draft}, got {start}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if max_pause < 0:
            raise ValueError(f"max_pause must be >= 0, got {max_pause}")
        self.max_draft = max_draft
        self.patience = patience
        self.max_pause = max_pause
        self._length = start
        self._misses = 0               # verifies in a row with nothing accepted
        self._next_pause = min(FIRST_PAUSE, max_pause)
        self._pause_left = 0
        self.proposed_total = 0
        self.accepted_total = 0
        self.verifies = 0

    @property
    def length(self) -> int:
        """The current draft length (1..max_draft), paused or not."""
        return self._length

    @property
    def paused(self) -> bool:
        """Whether the next `next` call returns 0."""
        return self._pause_left > 0

    def next(self) -> int:
        """The draft length to propose this step: 0 while paused (each call during a pause
        counts one step of it down), else the current length (1..max_draft)."""
        if self._pause_left > 0:
            self._pause_left -= 1
            return 0
        return self._length

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` (0..proposed) of `proposed` draft tokens."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted} of {proposed}")
        if proposed == 0:
            return
        self.verifies += 1
        self.proposed_total += proposed
        self.accepted_total += accepted
        if accepted == 0:
            self._on_miss()
            return
        self._misses = 0
        self._next_pause = min(FIRST_PAUSE, self.max_pause)
        grown = 2 * self._length if accepted == proposed else accepted + 1
        self._length = min(self.max_draft, grown)

    def _on_miss(self) -> None:
        self._length = 1
        self._misses += 1
        if self._misses >= self.patience:
            self._misses = 0
            self._pause_left = self._next_pause
            self._next_pause = min(self.max_pause, 2 * self._next_pause)
