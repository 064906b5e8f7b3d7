"""Speculative decoding with a draft model (`--speculative draft`): the real Scheduler
asking for drafts, the real ModelRunner drafting them with a second model and
verifying them, in one process.

Greedy rows match mlx_lm token for token, whatever the draft; sampled rows keep their
distribution (rejection sampling against the draft's), and a seeded one repeats
itself; the draft's KV follows the rows through prefix hits, chunked prefill and
retraction (its slots are the model's). Drafts: the model itself (every greedy draft
accepted), the model with its weights perturbed (most accepted), and a smaller model
of its own (few)."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxd.model_store.tiny import TinySpec, build_tiny_model, training_corpus
from mlxd.protocol import DecodeRow, SamplingParams, Step
from mlxd.scheduler_proc.speculation import SpecConfig
from mlxd.worker_proc.decode import UnsupportedModel
from mlxd.worker_proc.draft_model import check_draft, same_vocabulary
from mlxd.worker_proc.model_runner import probe_geometry, probe_vocab_size
from support import PROMPTS, encode, load_reference
from test_speculative import (
    OFF, Engine, assert_matches_mlx_lm, assert_speculated, chi_square_p, repeated,
    sample_continuations,
)

DRAFT = SpecConfig("draft", max_batch=64)


@pytest.fixture(scope="module")
def drafts(llama_model, tmp_path_factory) -> dict:
    """name -> a draft model's folder for the llama fixture: itself, its weights
    perturbed, a smaller model with its tokenizer."""
    import shutil

    root = tmp_path_factory.mktemp("drafts")
    near = root / "near"
    shutil.copytree(llama_model, near)
    model, _ = load_reference(llama_model)
    noise = {k: v + 0.05 * mx.random.normal(v.shape, key=mx.random.key(i)).astype(v.dtype)
             * mx.abs(v).mean() for i, (k, v) in enumerate(tree_flatten(model.parameters()))}
    mx.save_safetensors(str(near / "model.safetensors"), noise)
    small = build_tiny_model(root / "small", TinySpec(
        arch="llama", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=128, vocab_size=512, seed=7), corpus=training_corpus(seed=0))
    return {"self": llama_model, "near": str(near), "small": str(small)}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("draft", ["self", "near", "small"])
def test_greedy_rows_match_mlx_lm_whatever_the_draft(draft, overlap, llama_model, drafts):
    """Rows arriving at different steps, a second copy of a prompt (its prefix and the
    draft's KV read from the pool), a plain prompt beside repetitive ones."""
    requests = {0: (repeated(0), 40), 1: (repeated(1, times=3, tail=3), 25),
                2: (encode(llama_model, PROMPTS[3]), 30), 3: (repeated(0), 33),
                4: (repeated(2, block=8), 18)}
    arrivals = {0: [(0, *requests[0]), (2, *requests[2])], 3: [(1, *requests[1])],
                7: [(3, *requests[3]), (4, *requests[4])]}
    e = Engine(llama_model, spec=DRAFT, overlap=overlap, draft=drafts[draft])
    e.run(arrivals)
    c = e.counters
    assert c["method"] == "draft" and c["verifies"] > 0, c
    if draft == "self":   # the model drafting for itself: every draft token accepted
        assert c["accepted_tokens"] == c["draft_tokens"], c
    if draft == "near":
        assert c["accepted_tokens"] > c["draft_tokens"] // 2, c
    assert all(not row.draft for step in e.steps for row in step.decodes)   # the worker drafts
    assert_matches_mlx_lm(llama_model, e, requests)
    assert e.final[3].usage.cached_tokens > 0
    e.assert_idle_and_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_and_retraction_keep_the_draft_exact(overlap, llama_model, drafts):
    """A pool too small for every row's output and prompts in chunks: rows are
    retracted and resumed from the pool, the draft's KV with them."""
    requests = {rid: (repeated(rid % 3, times=3, tail=rid), 48) for rid in range(6)}
    e = Engine(llama_model, spec=DRAFT, overlap=overlap, kv_capacity=320, chunk=16,
               draft=drafts["near"])
    e.run({0: [(rid, *requests[rid]) for rid in requests]})
    assert e.scheduler.num_retractions > 0
    assert_speculated(e, "draft")
    assert_matches_mlx_lm(llama_model, e, requests)
    e.assert_idle_and_whole()


def test_a_draft_whose_kv_were_stale_would_be_caught(llama_model, drafts):
    """The draft's KV at a cached prefix are what its prefill wrote: a second copy of a
    prompt drafts as well as the first (a self-draft accepts every token of both)."""
    e = Engine(llama_model, spec=DRAFT, draft=drafts["self"])
    e.run({0: [(0, repeated(0), 30)], 40: [(1, repeated(0), 30)]})
    assert e.final[1].usage.cached_tokens > 0
    assert e.final[1].usage.accepted_tokens > 0
    c = e.counters
    assert c["accepted_tokens"] == c["draft_tokens"]


@pytest.mark.parametrize("name", ["temperature", "penalties"])
def test_seeded_rows_repeat_themselves(name, llama_model, drafts):
    """A seeded row's draws all have keys: run twice, the same draft gives the same
    tokens (not those of speculation off, whose draws differ)."""
    sampling = {"temperature": SamplingParams(temperature=1.0, seed=3, top_p=0.95),
                "penalties": SamplingParams(temperature=0.8, seed=1, presence_penalty=0.5,
                                            repetition_penalty=1.2)}[name]
    outs = []
    for _ in range(2):
        e = Engine(llama_model, spec=DRAFT, draft=drafts["near"])
        e.run({0: [(0, repeated(0), 40, sampling), (1, repeated(1), 40, sampling)]})
        assert e.counters["accepted_tokens"] > 0
        outs.append([e.tokens(0), e.tokens(1)])
    assert outs[0] == outs[1]


def test_sampled_rows_keep_their_distribution(llama_model, drafts):
    """Rejection sampling against the draft's distribution: at temperature 1 the token
    at position 4 and the first three tokens are distributed as without drafts."""
    on, counters = sample_continuations(llama_model, DRAFT, seed=1, draft=drafts["near"])
    off, _ = sample_continuations(llama_model, OFF, seed=2)
    assert counters["verifies"] > 0 and 0 < counters["accepted_tokens"] < counters["draft_tokens"]
    assert chi_square_p([t[4] for t in on], [t[4] for t in off]) > 0.001
    assert chi_square_p([tuple(t[:3]) for t in on], [tuple(t[:3]) for t in off]) > 0.001


def test_a_constrained_row_drafts_from_the_model_exactly(llama_model, drafts):
    """A grammar row's model drafts are cut at the first token its grammar refuses
    and checked position by position: the greedy tokens of speculation off."""
    from mlxd.tokenizer_proc.constraints import ConstraintCompiler, parse_response_format
    from mlxd.tokenizer_proc.text import TextCodec
    from structured_support import response_formats

    grammar = ConstraintCompiler(TextCodec(llama_model)).compile(
        parse_response_format(response_formats()["json_schema"]))
    outs = []
    for spec, draft in ((OFF, None), (DRAFT, drafts["near"])):
        e = Engine(llama_model, spec=spec, grammars=True, draft=draft)
        e.run({0: [(0, repeated(0), 40, SamplingParams(grammar=grammar)),
                   (1, repeated(1), 30)]})
        outs.append(e)
    assert outs[1].counters["verifies"] > 0
    for rid in range(2):
        assert outs[0].tokens(rid) == outs[1].tokens(rid)


def test_a_worker_without_a_draft_model_refuses_its_drafts(llama_model):
    e = Engine(llama_model)
    e.add(0, repeated(0), 10)
    e.step()
    with pytest.raises(ValueError, match="draft model"):
        e.runner.run(Step(99, [DecodeRow(0, 300, draft_slots=[301], model_draft=1)]))


def test_draft_models_that_cannot_serve_are_refused(llama_model, hybrid_model, tmp_path):
    model, tokenizer = load_reference(llama_model)
    other = build_tiny_model(tmp_path / "other", TinySpec(
        arch="llama", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=128, vocab_size=512, seed=5))   # a tokenizer of its own
    _, other_tokenizer = load_reference(str(other))
    assert same_vocabulary(tokenizer._tokenizer, tokenizer._tokenizer)
    assert not same_vocabulary(tokenizer._tokenizer, other_tokenizer._tokenizer)
    for arch, why in (("lfm2", "plain KV"), ("gemma3_text", "plain KV")):
        draft, _ = load_reference(hybrid_model(arch))
        with pytest.raises(UnsupportedModel, match=why):
            check_draft(probe_geometry(draft), probe_vocab_size(draft), probe_vocab_size(model))
    with pytest.raises(UnsupportedModel, match="vocabulary"):
        check_draft(probe_geometry(model), 1024, probe_vocab_size(model))


@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3_text"])
def test_a_hybrid_or_windowed_model_drafts_from_a_draft_model_exactly(arch, hybrid_model,
                                                                      drafts):
    """The model may keep recurrent state (its verify replays the kept positions) or
    sliding windows (a window pool): greedy rows as mlx_lm's with a draft model."""
    path = hybrid_model(arch)   # (its tokenizer is the llama fixture's)
    requests = {0: (repeated(0), 30), 1: (repeated(1, times=3), 24), 2: (repeated(0), 20)}
    e = Engine(path, spec=DRAFT, draft=drafts["small"])
    e.run({0: [(0, *requests[0]), (1, *requests[1])], 5: [(2, *requests[2])]})
    assert e.counters["verifies"] > 0
    assert_matches_mlx_lm(path, e, requests)
    e.assert_idle_and_whole()
