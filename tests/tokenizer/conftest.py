"""Fixtures of the tokenizer process tests: one real tokenizer process per module,
checked alive and drained around each test."""

import pytest

from test_tokenizer_proc import TokenizerProc


@pytest.fixture(scope="module")
def tok_proc(llama_model, tmp_path_factory):
    with TokenizerProc(llama_model, tmp_path_factory.mktemp("tokenizer")) as t:
        yield t


@pytest.fixture
def tok(tok_proc):
    tok_proc.ensure_alive()
    tok_proc.drain()
    yield tok_proc
    assert tok_proc.proc.poll() is None, "the tokenizer process died:\n" + tok_proc.log()
