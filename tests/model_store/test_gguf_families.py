"""GGUF families beyond llama, and GGUF's SentencePiece tokenizer.

Each family's GGUF is written here from a tiny random-weight mlx_lm model the way
llama.cpp's exporter writes it (gguf_writer.write_model: gguf-py's tensor names,
llama's Q/K permutation, Gemma's 1 + w norms, fused or stacked tensors as the HF
model has them), converted, and must generate what mlx_lm generates on the original
model with the values gguf's reference dequantizer decodes.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from transformers import AutoTokenizer

from gguf_writer import (assert_same_tokenization, bpe_tokenizer_metadata,
                         sentencepiece_tokenizer_metadata, write_model)
from mlxd.model_store.gguf import GGUFError, convert
from mlxd.model_store.tiny import CHAT_TEMPLATE, TinySpec, build_tiny_model, training_corpus
from mlxd.worker_proc.loading import load_model
from support import PROMPTS, Server

COMMON = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
              vocab_size=384)
# head_dim 16; what llama.cpp assumes where the file says nothing (Gemma's attention
# scale 1/sqrt(head_dim), Gemma 3's every-6th-layer global attention) is set to match
FAMILIES = {
    "qwen2": TinySpec(arch="qwen2", seed=11, **COMMON),
    "qwen3": TinySpec(arch="qwen3", tie_word_embeddings=True, seed=12, **COMMON),
    "mistral": TinySpec(arch="mistral", seed=13, **{**COMMON, "vocab_size": 512}),
    # 6 layers: mlx_lm's gemma3_text needs one global layer, and llama.cpp's is the 6th
    "gemma3_text": TinySpec(arch="gemma3_text", tie_word_embeddings=True, seed=14, extra=(
        ("sliding_window", 8), ("sliding_window_pattern", 6), ("query_pre_attn_scalar", 16),
        ("rope_local_base_freq", 10000.0),
        ("rope_scaling", {"rope_type": "linear", "factor": 8.0})), **{**COMMON, "num_layers": 6}),
    "gemma2": TinySpec(arch="gemma2", tie_word_embeddings=True, seed=15, extra=(
        ("query_pre_attn_scalar", 16), ("attn_logit_softcapping", 50.0),
        ("final_logit_softcapping", 30.0)), **COMMON),
    "phi3": TinySpec(arch="phi3", seed=16, **COMMON),
    "qwen3_moe": TinySpec(arch="qwen3_moe", seed=17, extra=(
        ("num_experts", 4), ("num_experts_per_tok", 2), ("decoder_sparse_step", 1),
        ("mlp_only_layers", []), ("moe_intermediate_size", 64), ("norm_topk_prob", True)),
        **COMMON),
}
MODEL_TYPE = {"mistral": "llama"}   # what the converted folder says
TEXTS = ["Hello model server", "What is the capital of France? 12345 + 678",
         "Ünïcödé ½ € 日本語 😀 naïve café", "  leading and   inner  spaces\n\nnew lines\t",
         "<s> special </s> tokens inside text", ""]


def randomize_vectors(folder: Path, seed: int) -> None:
    """Norm weights and biases away from their initial constants, so that a norm
    offset left in place, or a bias dropped, changes the model. A tied model keeps
    no lm_head (mlx_lm's gemma3_text builds one whatever its config says)."""
    rng = np.random.default_rng(seed)
    path = str(folder / "model.safetensors")
    weights = mx.load(path)
    if json.loads((folder / "config.json").read_text())["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    for name, value in weights.items():
        if value.ndim == 1:
            weights[name] = value + mx.array(rng.normal(0, 0.3, value.shape).astype(np.float32))
    mx.save_safetensors(path, weights)


def sentencepiece_tokenizer(folder: Path, size: int) -> None:
    """A SentencePiece-style (Llama 2 / Mistral) tokenizer.json in `folder`: BPE with
    byte fallback over <0x00>..<0xFF>, "▁" for spaces prepended to the first word,
    <unk> <s> </s> first; trained on the tiny corpus less its non-ASCII line, which
    is then written in bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, \
        processors, trainers

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    ascii_lines = [line for line in training_corpus() if line.isascii()]
    trainer_tok.train_from_iterator(ascii_lines, trainers.BpeTrainer(
        vocab_size=size - 259, show_progress=False))
    trained = trainer_tok.get_vocab()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained, key=trained.get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in json.loads(trainer_tok.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")

    def source(family: str) -> Path:
        folder = root / family
        if not folder.exists():
            build_tiny_model(folder, FAMILIES[family])
            randomize_vectors(folder, FAMILIES[family].seed)
            if family == "mistral":   # Mistral's and Llama 2's GGUFs carry SentencePiece
                sentencepiece_tokenizer(folder, FAMILIES[family].vocab_size)
        return folder
    return source


def tokenizer_metadata(folder: Path) -> dict:
    if json.loads((folder / "tokenizer.json").read_text())["model"].get("byte_fallback"):
        return sentencepiece_tokenizer_metadata(folder)
    return bpe_tokenizer_metadata(folder)


def generations(model, tokenizer, prompts, max_tokens=12):
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        out.append([(r.token, r.logprobs[r.token].item())
                    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)])
    return out


def reference_model(src: Path, expected: dict):
    model, tokenizer = load(str(src))
    model.load_weights([(k, mx.array(v)) for k, v in expected.items()])
    return model, tokenizer


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_serves_what_mlx_lm_serves_on_the_original(family, kind, sources, tmp_path):
    src = sources(family)
    expected = write_model(src, tmp_path / "m.gguf", kind, tokenizer_metadata(src))
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE.get(family, family)
    reference, tokenizer = reference_model(src, expected)
    want = generations(reference, tokenizer, PROMPTS[:4])
    assert len({tuple(t for t, _ in g) for g in want}) > 1   # not one repeated answer
    # and every logit: a tiny model's chosen tokens can be near-certain either way
    ids = mx.array(tokenizer.encode(PROMPTS[3] * 2))[None]
    want_logits = np.array(reference(ids))
    for dequantize in (True, False):
        model, _ = load_model(str(out), dequantize=dequantize)
        got = generations(model, tokenizer, PROMPTS[:4])
        for g, w in zip(got, want):
            assert [t for t, _ in g] == [t for t, _ in w], (dequantize, g, w)
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-3
        np.testing.assert_allclose(np.array(model(ids)), want_logits, rtol=1e-4, atol=1e-3)


# Every type the converter takes, per family: matrices rows of 256 (a K-quant's
# super-block), so every type packs every matrix.
ALL_KINDS = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
             "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
WIDE = {"hidden_size": 256, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def wide_sources(tmp_path_factory):
    """The families' models with hidden and feed-forward sizes of 256 (and 256-wide
    experts)."""
    import dataclasses

    root = tmp_path_factory.mktemp("wide-families")

    def source(family: str) -> Path:
        folder = root / family
        if not folder.exists():
            spec = FAMILIES[family]
            extra = tuple((k, 256 if k == "moe_intermediate_size" else
                           64 if k == "query_pre_attn_scalar" else v) for k, v in spec.extra)
            build_tiny_model(folder, dataclasses.replace(spec, **{
                "hidden_size": 256, "intermediate_size": 256}, extra=extra))
            randomize_vectors(folder, spec.seed)
            if family == "mistral":
                sentencepiece_tokenizer(folder, spec.vocab_size)
        return folder
    return source


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_type_of_every_family(family, kind, wide_sources, tmp_path):
    """Each family written with every matrix in `kind`: both loading forms generate
    what mlx_lm generates on the reference dequantizer's values (tokens equal,
    chosen-token logprobs within 1e-3)."""
    src = wide_sources(family)
    expected = write_model(src, tmp_path / "m.gguf", kind, tokenizer_metadata(src))
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    reference, tokenizer = reference_model(src, expected)
    want = generations(reference, tokenizer, PROMPTS[:2], max_tokens=8)
    for dequantize in (True, False):
        model, _ = load_model(str(out), dequantize=dequantize)
        got = generations(model, tokenizer, PROMPTS[:2], max_tokens=8)
        for g, w in zip(got, want):
            assert [t for t, _ in g] == [t for t, _ in w], (dequantize, g, w)
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-3


@pytest.mark.parametrize("merges", [True, False])
def test_a_sentencepiece_tokenizer_round_trips(merges, sources, tmp_path):
    """GGUF's "llama" tokenizer model (with merges, or only the scores, from which
    the merges are derived) encodes and decodes as the tokenizer it was written from."""
    src = sources("mistral")
    meta = sentencepiece_tokenizer_metadata(src, merges=merges)
    write_model(src, tmp_path / "m.gguf", "F32", meta)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    original, rebuilt = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(out))
    assert_same_tokenization(original, rebuilt, TEXTS + training_corpus(n_lines=20, seed=5))
    assert (rebuilt.bos_token, rebuilt.eos_token, rebuilt.unk_token) == ("<s>", "</s>", "<unk>")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert rebuilt.apply_chat_template(messages, add_generation_prompt=True) == \
        original.apply_chat_template(messages, add_generation_prompt=True)


def test_a_qwen3_file_through_the_server(sources, tmp_path):
    """End to end through mlxd: tokens and logprobs mlx_lm gives on the original."""
    src, gguf = sources("qwen3"), tmp_path / "served.gguf"
    expected = write_model(src, gguf, "Q8_0", tokenizer_metadata(src))
    env = {**os.environ, "MLXD_CACHE_DIR": str(tmp_path / "cache")}
    server = Server(str(gguf), "--kv-capacity", "4096", "--log-level", "warning", env=env)
    try:
        from mlxd.client import Client

        reference, tokenizer = reference_model(src, expected)
        with Client(server.address, timeout=60) as c:
            for prompt in PROMPTS[:3]:
                ids = tokenizer.encode(prompt)
                result = c.generate(input_ids=ids, max_tokens=12, logprobs=True)
                ref = [(r.token, r.logprobs[r.token].item())
                       for r in stream_generate(reference, tokenizer, ids, max_tokens=12)]
                assert result.token_ids == [t for t, _ in ref]
                assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3
    finally:
        server.stop()


def test_a_tokenizer_model_nothing_builds_is_a_clear_error(sources, tmp_path):
    src = sources("qwen2")
    meta = {**bpe_tokenizer_metadata(src), "tokenizer.ggml.model": "bert"}
    write_model(src, tmp_path / "m.gguf", "F32", meta)
    with pytest.raises(GGUFError, match="tokenizer 'bert'"):
        convert(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
