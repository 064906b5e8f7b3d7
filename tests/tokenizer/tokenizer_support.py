"""The byte-level BPE tokenizer of the detokenizer and request-stream tests, as
module-scoped fixtures: import `tokenizer` and `decode` into the test module."""

import pytest
from transformers import PreTrainedTokenizerFast

from mlxd.model_store.tiny import train_tokenizer, training_corpus


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(512, training_corpus()))


@pytest.fixture(scope="module")
def decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
