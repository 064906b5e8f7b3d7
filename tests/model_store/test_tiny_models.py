"""The tiny random-weight test models must be useful references: greedy decoding that
repeats one token whatever the prompt would hide a broken cache or state."""

import pytest

from mlxd.model_store.tiny import HYBRID_EXTRA
from support import PROMPTS, encode, reference_tokens


@pytest.mark.parametrize("arch", sorted(HYBRID_EXTRA))
def test_greedy_output_of_each_hybrid_test_model_varies(arch, hybrid_model):
    path = hybrid_model(arch)
    outputs = [[t for t, _ in reference_tokens(path, encode(path, p), 16, ignore_eos=True)]
               for p in PROMPTS[:2]]
    assert all(len(set(out)) >= 4 for out in outputs), outputs
    assert outputs[0] != outputs[1]
