"""Grammar-constrained decoding: one llguidance matcher per constrained row, and the
token masks the matchers allow.

A row's matcher advances on each token the row keeps (`RowGrammar.advance`, once the
step's tokens are read); the mask for its next position is computed from it on a
thread while the model computes that position's logits (`Grammars.start_masks`), and
applied to the logits in the batch's one sampling (sampling.py); a verify's draft positions
are masked as the matcher would be after the draft's tokens before each (llguidance
advances and rolls back a matcher through them). Unconstrained rows
get an all-ones mask row, or no mask at all when no row is constrained. A matcher
that stopped (the grammar is complete) or failed allows only EOS, so the row ends
with finish_reason "stop".
"""

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlxd.worker")

COMPILED_GRAMMARS = 64   # distinct grammars kept compiled (n choices, repeated schemas)


class RowGrammar:
    """The grammar state of one running request."""

    def __init__(self, matcher):
        self.matcher = matcher
        self._reported = False   # a refused token is logged once per row

    def valid_draft(self, draft: list[int]) -> list[int]:
        """The draft up to its first token the grammar refuses there: the row's own
        choice at that position is masked to the tokens the grammar takes, so it
        could never equal the refused one (nor the tokens after it count)."""
        return draft[:self.matcher.validate_tokens(draft)] if draft else draft

    def advance(self, token: int) -> None:
        """Consume a token the row keeps. A token the grammar refuses (none should
        be: the mask forbids it) leaves the matcher failed, which allows only EOS."""
        if not self.matcher.consume_token(token) and not self._reported:
            log.warning("grammar refused token %d: %s", token, self.matcher.get_error())
            self._reported = True


class Grammars:
    """The worker's llguidance tokenizer, built once at load from the model's
    Hugging Face tokenizer, and the thread masks are computed on. `vocab_size` is
    the logits' width; `eos_ids` the ids a finished grammar allows (a subset of
    every request's stop ids)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: list[int]):
        import llguidance
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, vocab_size,
                                                      eos_token=sorted(eos_ids))
        self.words = (vocab_size + 31) // 32   # int32 words per mask row
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, "grammar-masks")
        self._compiled = lru_cache(COMPILED_GRAMMARS)(self._compile)

    @classmethod
    def for_model(cls, tokenizer, vocab_size: int) -> "Grammars | None":
        """From mlx_lm's tokenizer wrapper (the model's own EOS ids); None, logged,
        where llguidance cannot read the tokenizer (a slow one)."""
        try:
            return cls(tokenizer._tokenizer, vocab_size, list(tokenizer.eos_token_ids))
        except Exception as exc:
            log.warning("constrained decoding is off: llguidance cannot use this "
                        "tokenizer (%s: %s)", type(exc).__name__, exc)
            return None

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar does not compile: {matcher.get_error()[:400]}")
        return matcher

    def row(self, grammar: str, output_ids: list[int] = ()) -> RowGrammar:
        """A fresh row state for `grammar` (raises ValueError if it does not compile),
        advanced over `output_ids` (a resumed request's tokens so far)."""
        row = RowGrammar(self._compiled(grammar).deep_copy())
        for token in output_ids:
            row.advance(token)
        return row

    def start_masks(self, rows: list, live: list[bool] | None = None) -> Future | None:
        """Start computing the next position's mask of `rows` (RowStates; `live[i]`
        False for a dead row, which gets no constraint) on the mask thread: a Future
        of an int32 bitmask [rows, words]. None when no row is constrained."""
        constrained = [(r.grammar.matcher, i) for i, r in enumerate(rows)
                       if r.grammar is not None and (live is None or live[i])]
        if not constrained:
            return None
        return self._thread.submit(self._fill, constrained, len(rows))

    def start_draft_masks(self, rows: list, drafts: list[list[int]]) -> Future | None:
        """Like `start_masks` for a verify: row i's positions are its next one and
        one after each token of `drafts[i]` (rows' positions in turn), each masked
        as the row's matcher would be with the draft's tokens before it consumed.
        The drafts must be ones the matchers take whole (`valid_draft`)."""
        constrained, at = [], 0
        for r, d in zip(rows, drafts):
            if r.grammar is not None:
                constrained.append((r.grammar.matcher, at, list(d)))
            at += 1 + len(d)
        if not constrained:
            return None
        return self._thread.submit(self._fill_drafts, constrained, at)

    def _fill(self, constrained: list, n: int) -> np.ndarray:
        bitmask = np.full((n, self.words), -1, dtype=np.int32)   # all allowed
        self._executor.unsafe_compute_mask_ptr(constrained, bitmask.ctypes.data,
                                               self.words * 4, n)
        return bitmask

    def _fill_drafts(self, constrained: list, n: int) -> np.ndarray:
        bitmask = np.full((n, self.words), -1, dtype=np.int32)
        one = [(m, at) for m, at, d in constrained if not d]   # llguidance wants drafts
        drafting = [c for c in constrained if c[2]]
        for compute, rows in ((self._executor.unsafe_compute_mask_ptr, one),
                              (self._executor.unsafe_compute_mask_ptr_with_draft_token, drafting)):
            if rows:
                compute(rows, bitmask.ctypes.data, self.words * 4, n)
        return bitmask

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def allowed(bitmask: np.ndarray, vocab: int) -> mx.array:
    """The bool [rows, vocab] mask of an int32 bitmask (bit j of word w: token 32w+j)."""
    words = mx.array(bitmask)
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab] > 0
