"""response_format: its shape (params.py), its compilation against the vocabulary
(constraints.py) and the grammar the core sends the scheduler."""

from types import SimpleNamespace

import pytest

from mlxd.protocol import ErrorReply, GenerateRequest, TokenizedRequest
from mlxd.tokenizer_proc.constraints import (
    ConstraintCompiler, InvalidConstraint, parse_response_format,
)
from mlxd.tokenizer_proc.core import TokenizerCore
from mlxd.tokenizer_proc.params import InvalidRequest, parse_params
from mlxd.tokenizer_proc.text import TextCodec
from structured_support import SCHEMA, response_formats
from support import worker_limits

LIMITS = worker_limits(kv_capacity=1000, max_context=200, vocab_size=512)


@pytest.fixture(scope="module")
def codec(llama_model):
    return TextCodec(llama_model)


@pytest.fixture(scope="module")
def compiler(codec):
    return ConstraintCompiler(codec)


@pytest.mark.parametrize("value", [None, {"type": "text"}])
def test_text_and_no_response_format_constrain_nothing(value):
    assert parse_response_format(value) is None


@pytest.mark.parametrize("value, problem", [
    ("json", "must be an object"),
    ({"type": "xml"}, "must be an object whose type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema must be"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "regex"}, "needs a non-empty string field 'regex'"),
    ({"type": "grammar", "grammar": ""}, "needs a non-empty string field 'grammar'"),
])
def test_malformed_response_formats_are_refused_by_name(value, problem):
    with pytest.raises(InvalidRequest, match="response_format") as exc:
        parse_params({"response_format": value}, 512, 16)
    assert problem in str(exc.value)


def test_a_schema_under_json_object_is_honoured():
    """The shape llama.cpp, Together and Fireworks accept (issue 23, item 5)."""
    assert parse_response_format({"type": "json_object", "schema": SCHEMA}) == \
        parse_response_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    with pytest.raises(InvalidRequest, match="response_format.*schema must be"):
        parse_params({"response_format": {"type": "json_object", "schema": "x"}}, 512, 16)


@pytest.mark.parametrize("value, key", [
    ({"type": "json_object", "shema": {}}, "shema"),
    ({"type": "text", "json_schema": {}}, "json_schema"),
    ({"type": "regex", "regex": "a", "grammar": "b"}, "grammar"),
    ({"type": "grammar", "grammar": "start: \"a\"", "strict": True}, "strict"),
    ({"type": "json_schema", "json_schema": {"schema": {}}, "schema": {}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True,
                                             "format": "y"}}, "format"),
])
def test_keys_the_server_does_not_use_are_refused_by_name(value, key):
    with pytest.raises(InvalidRequest, match="response_format") as exc:
        parse_params({"response_format": value}, 512, 16)
    assert f"{key!r}" in str(exc.value)


def test_openais_json_schema_description_is_accepted():
    spec = {"name": "x", "description": "a person", "schema": SCHEMA, "strict": False}
    assert parse_response_format({"type": "json_schema", "json_schema": spec}).source == SCHEMA


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 3}])
def test_a_constraint_keeps_eos_free(extra):
    with pytest.raises(InvalidRequest, match="response_format cannot be combined"):
        parse_params({"response_format": {"type": "json_object"}, **extra}, 512, 16)


def test_every_kind_compiles(compiler):
    formats = response_formats() | {"json_object": {"type": "json_object"}}
    for rf in formats.values():
        assert compiler.compile(parse_response_format(rf))


def test_a_lark_grammar_may_embed_a_json_schema(compiler):
    lark = 'start: "<call>" args "</call>"\nargs: %json ' + str(SCHEMA).replace(
        "'", '"').replace("False", "false") + "\n"
    assert compiler.compile(parse_response_format({"type": "grammar", "grammar": lark}))


@pytest.mark.parametrize("rf, problem", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}},
     "json_schema does not compile"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}},
     "json_schema does not compile"),
    ({"type": "regex", "regex": "a(("}, "regex does not compile"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "grammar does not compile"),
    ({"type": "grammar", "grammar": "start: %json {nope}"}, "grammar does not compile"),
])
def test_constraints_that_do_not_compile_are_refused_naming_the_problem(compiler, rf, problem):
    with pytest.raises(InvalidConstraint, match="response_format") as exc:
        compiler.compile(parse_response_format(rf))
    assert problem in str(exc.value)


def letters_codec():
    """A byte-level codec trained without the full byte alphabet: it can spell a few
    words' letters and nothing else (no digits)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["yes no maybe"] * 10, trainers.BpeTrainer(
        vocab_size=40, special_tokens=["</s>"], show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    return SimpleNamespace(tokenizer=hf, vocab_size=len(hf))


def test_a_constraint_the_vocabulary_cannot_spell_is_refused():
    compiler = ConstraintCompiler(letters_codec())
    assert compiler.compile(parse_response_format({"type": "regex", "regex": "yes|no"}))
    with pytest.raises(InvalidConstraint, match="no token of the model's vocabulary"):
        compiler.compile(parse_response_format({"type": "regex", "regex": "[0-9]+"}))


def submit(core: TokenizerCore, rid="r", **params) -> list:
    replies = []
    sent = core.submit(b"a", GenerateRequest(rid, prompt="Hello", params=params),
                       replies.append)
    return sent + replies


def test_the_core_ships_the_compiled_grammar_to_every_choice(codec, compiler):
    core = TokenizerCore(codec, 16, LIMITS)
    rf = response_formats()["regex"]
    sent = submit(core, response_format=rf, n=2, temperature=1.0)
    assert [type(m) for m in sent] == [TokenizedRequest, TokenizedRequest]
    want = compiler.compile(parse_response_format(rf))
    assert all(m.sampling.grammar == want for m in sent)
    assert all(m.sampling.grammar is None for m in submit(core, "plain", max_tokens=3))


def test_the_core_refuses_a_bad_constraint_before_the_scheduler_sees_it(codec):
    core = TokenizerCore(codec, 16, LIMITS)
    sent = submit(core, response_format={"type": "regex", "regex": "(("})
    assert len(sent) == 1 and isinstance(sent[0], ErrorReply)
    assert sent[0].code == "invalid_request" and "response_format" in sent[0].message
    core.check_integrity()


# ---- a reasoning model thinks first ----------------------------------------------------

def _accepts(compiler, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(compiler._ll_tokenizer(), grammar, log_level=0)
    for token in compiler._codec.tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_a_constraint_starts_after_the_thinking(compiler):
    from mlxd.tokenizer_proc.constraints import after_thinking

    grammar = compiler.compile(parse_response_format({"type": "regex", "regex": "[0-9]{3}"}))
    free = after_thinking(grammar, opened=False)
    assert _accepts(compiler, free, "<think>first {[ some\nthought</think>123")
    assert _accepts(compiler, free, "123")              # no thinking at all
    assert not _accepts(compiler, free, "<think>no end123")
    assert not _accepts(compiler, free, "<think>x</think>12a")
    opened = after_thinking(grammar, opened=True)       # the prompt opened the block
    assert _accepts(compiler, opened, "thinking...</think>123")
    assert not _accepts(compiler, opened, "123")
    assert _accepts(compiler, grammar, "123") and not _accepts(compiler, grammar, "<think>")
