"""Grammar-constrained rows in the ModelRunner: masks, one batch with unconstrained
rows, retraction, overlap."""

import mlx.core as mx
import numpy as np
import pytest

from mlxd.protocol import PrefillInput, SamplingParams
from mlxd.tokenizer_proc.constraints import ConstraintCompiler, parse_response_format
from mlxd.tokenizer_proc.text import TextCodec
from mlxd.worker_proc.grammar import Grammars, allowed
from mlxd.worker_proc.sampling import RowState, sample
from structured_support import response_formats, satisfies
from support import PROMPTS, encode, load_reference
from test_model_runner import Driver

MAX_TOKENS = 150


def test_allowed_reads_bit_j_of_word_w_as_token_32w_plus_j():
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :100] > 0
    assert (np.array(allowed(bitmask, 100)) == want).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_tokens_are_never_picked_and_logprobs_stay_raw(temperature):
    logits = mx.random.normal((4, 64), key=mx.random.key(1)) * 5
    mask = np.zeros((4, 64), dtype=bool)
    mask[:, [3, 17, 40]] = True
    mask[1] = True   # an unconstrained row
    rows = [RowState(SamplingParams(temperature=temperature, top_p=0.9, top_k=5), seed=i)
            for i in range(4)]
    out = sample(logits, rows, mx.array(mask))
    free = sample(logits, [RowState(r.params, r.seed) for r in rows])
    tokens = out.tokens.tolist()
    assert all(mask[i, t] for i, t in enumerate(tokens))
    assert tokens[1] == free.tokens.tolist()[1]   # all allowed: as without a mask
    raw = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert mx.allclose(out.logprobs, raw[mx.arange(4), out.tokens]).item()


@pytest.fixture(scope="module")
def grammars(llama_model) -> dict:
    """Each response_format's compiled grammar text, as the tokenizer process sends it."""
    compiler = ConstraintCompiler(TextCodec(llama_model))
    return {kind: compiler.compile(parse_response_format(rf))
            for kind, rf in response_formats().items()}


class GrammarDriver(Driver):
    """A Driver whose runner can constrain rows and which finishes a row at EOS or
    after MAX_TOKENS, as the scheduler does."""

    def __init__(self, model_path: str, overlap: bool = False):
        super().__init__(model_path)
        self.model_path = model_path
        _, tokenizer = load_reference(model_path)
        self.eos = set(tokenizer.eos_token_ids)
        self.runner.grammars = Grammars.for_model(tokenizer, self.runner.vocab_size)
        self.runner.overlap = overlap

    def finished(self) -> list[int]:
        return [r for r in self.running
                if self.out[r][-1][0] in self.eos or len(self.out[r]) >= MAX_TOKENS]

    def run(self, prefills: dict[int, list[PrefillInput]]):
        """Steps until every row finished; `prefills[step]` join at that step."""
        step = 0
        while self.running or any(s >= step for s in prefills):
            self.step(prefills.get(step, []), self.finished())
            step += 1
        self.runner.close()

    def text(self, rid: int) -> str:
        _, tokenizer = load_reference(self.model_path)
        return tokenizer.decode([t for t, _ in self.out[rid] if t not in self.eos])


def constrained(d: Driver, rid: int, ids: list[int], grammar: str | None, seed: int,
                output: list[int] = ()) -> PrefillInput:
    sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
    ids = ids + list(output)
    return PrefillInput(rid, ids, [], d.new_slots(rid, len(ids)), sampling,
                        num_generated=len(output), output_ids=list(output))


def tokens(d: Driver, rid: int) -> list[int]:
    return [t for t, _ in d.out[rid]]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "chained"])
def test_constrained_rows_follow_their_grammar_beside_unconstrained_ones(llama_model, grammars,
                                                                       overlap):
    kinds = list(grammars)
    ids = [encode(llama_model, p) for p in PROMPTS]
    d = GrammarDriver(llama_model, overlap)
    rows = {rid: (kinds[rid % 3] if rid % 2 else None) for rid in range(12)}

    def join(rid):
        return constrained(d, rid, ids[rid % 8], rows[rid] and grammars[rows[rid]], seed=rid)
    d.run({0: [join(rid) for rid in range(6)], 3: [join(rid) for rid in range(6, 12)]})
    for rid, kind in rows.items():
        if kind is not None:
            assert tokens(d, rid)[-1] in d.eos, (rid, d.text(rid))   # the grammar ended it
            assert satisfies(kind, d.text(rid)), (kind, d.text(rid))
    alone = GrammarDriver(llama_model)
    for rid in (0, 2, 4):   # an unconstrained row: what it samples alone
        alone.step([constrained(alone, rid, ids[rid % 8], None, seed=rid)])
    for _ in range(MAX_TOKENS - 1):
        alone.step()
    for rid in (0, 2, 4):
        assert tokens(alone, rid)[:len(tokens(d, rid))] == tokens(d, rid)


def test_a_resumed_row_replays_its_output_into_a_new_matcher(llama_model, grammars):
    ids = encode(llama_model, PROMPTS[1])
    whole = GrammarDriver(llama_model)
    whole.run({0: [constrained(whole, 1, ids, grammars["json_schema"], seed=7)]})
    want = tokens(whole, 1)
    assert len(want) > 8
    d = GrammarDriver(llama_model)
    d.step([constrained(d, 1, ids, grammars["json_schema"], seed=7)])
    for _ in range(5):
        d.step()
    d.step(releases=[1])   # retracted; resumed with prompt + output so far
    done = tokens(d, 1)
    d.step([constrained(d, 1, ids, grammars["json_schema"], seed=7, output=done)])
    while tokens(d, 1)[-1] not in d.eos and len(d.out[1]) < MAX_TOKENS:
        d.step()
    assert tokens(d, 1) == want


def test_a_worker_without_grammars_refuses_a_constrained_prefill(llama_model, grammars):
    d = Driver(llama_model)
    with pytest.raises(ValueError, match="constrained"):
        d.step([constrained(d, 1, [1, 5], grammars["regex"], seed=1)])


# ---- a verify's draft positions ----------------------------------------------------

def test_draft_masks_are_the_masks_after_each_draft_token_and_leave_the_matcher_as_it_was(
        llama_model, grammars):
    """`start_draft_masks` gives row i's positions the masks its matcher computes one
    token at a time with the draft's tokens before each; `valid_draft` cuts a draft
    at the first token the grammar refuses; neither moves the matcher."""
    _, tokenizer = load_reference(llama_model)
    g = Grammars.for_model(tokenizer, 512)
    try:
        row = g.row(grammars["regex"])   # (cat|dog)-[0-9]{2,4}
        take = list(tokenizer.encode("dog-12", add_special_tokens=False))
        draft = take + list(tokenizer.encode("x", add_special_tokens=False))
        valid = row.valid_draft(draft)
        assert valid == take   # "x" after "dog-12" is refused: the draft stops before it
        assert row.valid_draft([]) == []
        free = RowState(SamplingParams(), seed=0)
        constrained = RowState(SamplingParams(), seed=0, grammar=row)
        got = g.start_draft_masks([free, constrained], [[7], valid]).result()
        assert got.shape[0] == 2 + 1 + len(valid)
        assert (got[:2] == -1).all()   # the free row's positions: everything allowed
        want = []
        for j in range(len(valid) + 1):   # one token at a time, on a copy
            copy = g.row(grammars["regex"], valid[:j])
            want.append(g.start_masks([RowState(SamplingParams(), 0, grammar=copy)]).result()[0])
        assert (got[2:] == np.stack(want)).all()
        # the matcher did not move: its mask is the first position's
        again = g.start_masks([constrained]).result()[0]
        assert (again == want[0]).all()
    finally:
        g.close()
