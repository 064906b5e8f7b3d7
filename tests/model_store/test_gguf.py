"""GGUF -> mlx_lm folder conversion, on small GGUF files written by the tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx.utils import tree_flatten
from transformers import AutoTokenizer

from gguf_writer import assert_same_tokenization, bpe_tokenizer_metadata, write_gguf, write_model
from mlxd.model_store.gguf import (CONVERSION_VERSION, GGUFError, cached_conversion, convert,
                                   file_sha256, permute_rows, unpermute_rows)
from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import ROOT, PROMPTS, Server
from mlxd.worker_proc.loading import float32_bytes, load_for_serving, load_model
from mlxd.worker_proc.memory import ACTIVATION_RESERVE_BYTES

# rows of 256: the K-quants' and IQ4_XS's super-blocks
SPEC = TinySpec(arch="llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=512, vocab_size=384, seed=3)
TEXTS = ["Hello model server", "What is the capital of France? 12345 + 678",
         "Ünïcödé ½ € 日本語 😀 naïve café", "  leading and   inner  spaces\n\nnew lines\t",
         "<s> special </s> tokens <|user|> inside text", ""]


def write_model_gguf(folder: Path, path: Path, kind, permute: bool = True):
    """Write `folder`'s model as llama.cpp would (gguf_writer.write_model) with its
    byte-level BPE tokenizer. Returns the HF-named weights gguf's reference
    dequantizer decodes."""
    return write_model(folder, path, kind, bpe_tokenizer_metadata(folder), permute=permute)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    return {tied: build_tiny_model(root / f"tied-{tied}",
                                   TinySpec(**{**SPEC.__dict__, "tie_word_embeddings": tied}))
            for tied in (False, True)}


def load_dequantized(folder):
    """The worker's own loading path (float32 on the CPU backend)."""
    return load_model(str(folder), dequantize=True)


def logits(model, ids):
    return np.array(model(mx.array(ids)[None])[0].astype(mx.float32))


def folder_weights(folder: Path) -> dict[str, np.ndarray]:
    """The converted folder's tensors as float32 values, quantized ones through
    mx.dequantize with the folder's own quantization config."""
    config = json.loads((folder / "config.json").read_text())
    quantization = config.get("quantization", {})
    tensors = mx.load(str(folder / "model.safetensors"))
    out = {}
    for name, value in tensors.items():
        stem, kind = name.rsplit(".", 1)
        if kind in ("scales", "biases"):
            continue
        if f"{stem}.scales" in tensors:
            params = quantization.get(stem, quantization)
            value = mx.dequantize(value, tensors[f"{stem}.scales"], tensors.get(f"{stem}.biases"),
                                  params["group_size"], params["bits"],
                                  params.get("mode", "affine"))
        out[name] = np.array(value.astype(mx.float32))
    return out


def greedy(model, tokenizer, prompts, max_tokens=12):
    return [reference_tokens_for(model, tokenizer, tokenizer.encode(p), max_tokens)
            for p in prompts]


def assert_same_generations(got, want, bound=1e-3):
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < bound


# GGML type -> the form it is kept in (model_store/gguf_quants.py); all exact
EXACT_FORMS = {"Q4_0": ("affine", 4), "Q4_1": ("affine", 4), "Q4_K": ("affine", 4),
               "Q5_0": ("affine", 5), "Q5_1": ("affine", 5), "Q5_K": ("affine", 5),
               "Q8_0": ("affine", 8), "IQ4_NL": ("affine", 8), "IQ4_XS": ("affine", 8),
               "MXFP4": ("mxfp4", 4), "Q2_K": ("float32", 0), "Q3_K": ("float32", 0),
               "Q6_K": ("float32", 0), "F16": ("float16", 0), "BF16": ("bfloat16", 0)}


def q4_k_m(name: str) -> str:
    """Q4_K_M's mix, as llama.cpp writes it: Q6_K for the output and for half the
    layers' attn_v and ffn_down, Q4_K elsewhere."""
    sixes = {"output.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight"}
    return "Q6_K" if name in sixes else "Q4_K"


def check_generation(src, out, expected, bound=1e-3):
    """The worker's loading path, quantized and dequantized, generates what mlx_lm
    generates on `expected` (gguf.quants.dequantize's values): tokens equal,
    chosen-token logprobs within `bound`."""
    reference, tokenizer = load(str(src))
    reference.load_weights([(k, mx.array(v)) for k, v in expected.items()])
    want = greedy(reference, tokenizer, PROMPTS[:4])
    for dequantize in (True, False):
        model, _ = load_model(str(out), dequantize=dequantize)
        assert_same_generations(greedy(model, tokenizer, PROMPTS[:4]), want, bound)


@pytest.mark.parametrize("kind", sorted(EXACT_FORMS))
def test_a_quantized_file_serves_the_reference_dequantizers_weights(kind, tiny_folders,
                                                                    tmp_path):
    """Every 2-D weight in `kind`: served as mlx_lm serves gguf.quants.dequantize's
    values, and the folder's weights dequantize to exactly those values."""
    src = tiny_folders[False]
    expected = write_model_gguf(src, tmp_path / "m.gguf", kind)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    check_generation(src, out, expected)
    got = folder_weights(out)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert np.array_equal(got[name], value), name
    form, bits = EXACT_FORMS[kind]
    record = json.loads((out / "config.json").read_text())["gguf"]["forms"][kind]
    assert (record["form"], record.get("bits", 0), record["exact"]) == (form, bits, True)


def test_a_q4_k_m_mix_is_exact_with_its_q6_k_tensors_in_float32(tiny_folders, tmp_path):
    src = tiny_folders[False]
    expected = write_model_gguf(src, tmp_path / "m.gguf", q4_k_m)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    check_generation(src, out, expected)
    got = folder_weights(out)
    assert all(np.array_equal(got[name], value) for name, value in expected.items())
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert "model.layers.0.mlp.down_proj" not in config["quantization"]   # float32
    assert set(config["gguf"]["forms"]) == {"F32", "Q4_K", "Q6_K"}


# The re-quantized form's bound on chosen-token logprobs. Measured on this model over
# 12 prompts: up to 0.12 where the tokens agree, and one Q6_K prompt in 12 diverges;
# hence float32, exact, is the default.
Q8_LOGPROB_BOUND = 0.15


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q6_K"])
def test_types_without_an_exact_form_may_be_re_quantized_to_8_bits(kind, tiny_folders,
                                                                   tmp_path):
    """inexact="q8": 8-bit affine groups of 32 from the reference's values, relative
    RMS error under 6e-3 per tensor; generation within Q8_LOGPROB_BOUND."""
    src = tiny_folders[False]
    expected = write_model_gguf(src, tmp_path / "m.gguf", kind)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", inexact="q8")
    got = folder_weights(out)
    for name, value in expected.items():
        if value.ndim == 2:
            error = np.sqrt(np.mean((got[name] - value) ** 2) / np.mean(value ** 2))
            assert 0 < error < 6e-3, name
    record = json.loads((out / "config.json").read_text())["gguf"]["forms"][kind]
    assert record == {"form": "affine", "bits": 8, "group_size": 32, "exact": False}
    check_generation(src, out, expected, Q8_LOGPROB_BOUND)


def test_a_type_nothing_can_decode_is_refused_naming_the_tensor(tiny_folders, tmp_path):
    """mx.load dropped such a tensor, and every one after it, without a word."""
    src = tiny_folders[False]
    odd = "blk.1.ffn_up.weight"
    write_model_gguf(src, tmp_path / "m.gguf", lambda name: "Q8_1" if name == odd else "Q4_K")
    with pytest.raises(GGUFError, match=f"tensor '{odd}' has GGML type Q8_1"):
        convert(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("tied", [False, True])
def test_conversion_reproduces_the_weights_and_the_model(kind, tied, tiny_folders, tmp_path):
    src = tiny_folders[tied]
    expected = write_model_gguf(src, tmp_path / "m.gguf", kind)
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert ("quantization" in config) is kind.startswith("Q")
    model, _ = load_dequantized(out)
    got = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
    # The converted model computes what a model holding those values computes.
    reference, tokenizer = load(str(src))
    reference.load_weights([(k, mx.array(v)) for k, v in expected.items()])
    ids = tokenizer.encode(PROMPTS[3])
    np.testing.assert_allclose(logits(model, ids), logits(reference, ids), rtol=1e-4, atol=1e-4)


def test_q_and_k_rows_are_put_back_in_rotary_order(tiny_folders, tmp_path):
    """A file whose Q/K rows were not permuted by the writer converts to a
    different model: the un-permutation is real, and the test above would see it."""
    src = tiny_folders[False]
    write_model_gguf(src, tmp_path / "raw.gguf", "F32", permute=False)
    wrong, tokenizer = load_dequantized(convert(tmp_path / "raw.gguf", tmp_path / "raw"))
    right, _ = load(str(src))
    ids = tokenizer.encode(PROMPTS[3])
    assert not np.allclose(logits(wrong, ids), logits(right, ids), atol=1e-2)
    x = mx.arange(4 * 6 * 3).reshape(24, 3)
    assert mx.array_equal(unpermute_rows(permute_rows(x, 4), 4), x).item()


def test_the_rebuilt_tokenizer_matches_the_original(tiny_folders, tmp_path):
    src = tiny_folders[False]
    write_model_gguf(src, tmp_path / "m.gguf", "Q8_0")
    out = convert(tmp_path / "m.gguf", tmp_path / "out")
    original, rebuilt = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(out))
    assert_same_tokenization(original, rebuilt, TEXTS)
    assert (rebuilt.bos_token, rebuilt.eos_token) == (original.bos_token, original.eos_token)
    assert set(rebuilt.all_special_tokens) >= {"<s>", "</s>"}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    assert rebuilt.apply_chat_template(messages, add_generation_prompt=True) == \
        original.apply_chat_template(messages, add_generation_prompt=True)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == original.eos_token_id


def test_unsupported_inputs_are_clear_errors(tiny_folders, tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="cannot read"):
        convert(tmp_path / "junk.gguf", tmp_path / "out")
    x = np.zeros((4, 32), np.float32)
    write_gguf(tmp_path / "gpt2.gguf", {"w.weight": (x, "F32")}, {"general.architecture": "gpt2"})
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        convert(tmp_path / "gpt2.gguf", tmp_path / "out")


def test_cli_converts_and_reports_errors(tiny_folders, tmp_path):
    write_model_gguf(tiny_folders[False], tmp_path / "m.gguf", "Q4_1")
    cmd = [sys.executable, "-m", "mlxd.model_store.gguf"]
    ok = subprocess.run(cmd + [str(tmp_path / "m.gguf"), str(tmp_path / "cli")], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "cli" / "config.json").exists()
    bad = subprocess.run(cmd + [str(tmp_path / "missing.gguf"), str(tmp_path / "x")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error:" in bad.stderr


def test_conversions_are_cached_by_content(tiny_folders, tmp_path):
    write_model_gguf(tiny_folders[False], tmp_path / "a.gguf", "Q8_0")
    # an older converter's folder for the same file (mlxd < conversion version 2)
    old = tmp_path / "cache" / "gguf" / file_sha256(tmp_path / "a.gguf")[:32]
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    first = cached_conversion(tmp_path / "a.gguf", tmp_path / "cache")
    assert first != old and first.name.endswith(f"-v{CONVERSION_VERSION}")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    (tmp_path / "b.gguf").write_bytes((tmp_path / "a.gguf").read_bytes())
    assert cached_conversion(tmp_path / "b.gguf", tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    write_model_gguf(tiny_folders[True], tmp_path / "c.gguf", "Q8_0")
    assert cached_conversion(tmp_path / "c.gguf", tmp_path / "cache") != first


@pytest.mark.parametrize("dequantize", ["on", "off"])
def test_the_server_serves_a_q4_k_m_file_like_mlx_lm(dequantize, tiny_folders, tmp_path):
    """Through mlxd: the tokens and logprobs mlx_lm gives on the weights gguf's
    reference dequantizer decodes (Q4_K with Q6_K tensors)."""
    src, gguf = tiny_folders[False], tmp_path / "served.gguf"
    expected = write_model_gguf(src, gguf, q4_k_m)
    env = {**os.environ, "MLXD_CACHE_DIR": str(tmp_path / "cache")}
    server = Server(str(gguf), "--kv-capacity", "4096", "--dequantize", dequantize,
                    "--log-level", "warning", env=env)
    try:
        from mlxd.client import Client

        reference, tokenizer = load(str(src))
        reference.load_weights([(k, mx.array(v)) for k, v in expected.items()])
        with Client(server.address, timeout=60) as c:
            for prompt in PROMPTS[:3]:
                ids = tokenizer.encode(prompt)
                result = c.generate(input_ids=ids, max_tokens=12, logprobs=True)
                ref = reference_tokens_for(reference, tokenizer, ids, 12)
                assert result.token_ids == [t for t, _ in ref]
                assert max(abs(a - b) for a, (_, b) in zip(result.logprobs, ref)) < 1e-3
    finally:
        server.stop()


def test_an_interrupted_conversion_never_leaves_a_folder_that_looks_complete(tiny_folders,
                                                                            tmp_path):
    """A conversion killed midway leaves only its `.converting-<pid>-*` folder, which
    the next conversion removes; the cache then converts afresh."""
    gguf, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_model_gguf(tiny_folders[False], gguf, "Q4_K")
    killed = ("import os, sys\nimport mlxd.model_store.gguf as g\n"
              "g.tokenizer_config = lambda meta: os._exit(9)   # after the weights\n"
              "g.cached_conversion(sys.argv[1], sys.argv[2])\n")
    proc = subprocess.run([sys.executable, "-c", killed, str(gguf), str(cache)], cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 9
    left = list((cache / "gguf").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".converting-")
    assert (left[0] / "model.safetensors").exists()
    folder = cached_conversion(gguf, cache)
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [folder.name]
    assert json.loads((folder / "config.json").read_text())["gguf"]["conversion_version"] == \
        CONVERSION_VERSION


def test_auto_serves_float32_on_the_cpu_when_it_fits_the_memory_limit(tiny_folders, tmp_path):
    """--dequantize auto on the CPU backend: float32 when the float32 weights (and the
    activation reserve) fit the limit, else the exact quantized form; on/off as told."""
    write_model_gguf(tiny_folders[False], tmp_path / "m.gguf", q4_k_m)
    out = str(convert(tmp_path / "m.gguf", tmp_path / "out"))
    wide, _ = load_model(out, dequantize=True)
    need = float32_bytes(load(out)[0])
    assert need == float32_bytes(wide) == 4 * sum(v.size for _, v in tree_flatten(wide.parameters()))
    room = need + ACTIVATION_RESERVE_BYTES
    cpu = mx.default_device().type == mx.DeviceType.cpu   # auto: quantized on a GPU
    for choice, limit, dequantized in [("auto", room, cpu), ("auto", room - 1, False),
                                       ("auto", 0, cpu), ("on", 1, True), ("off", room, False)]:
        model, _, chosen = load_for_serving(out, choice, limit)
        assert chosen is dequantized, (choice, limit)
        quantized = {type(m).__name__ for _, m in model.named_modules()} & {"QuantizedLinear"}
        assert bool(quantized) is not dequantized


def reference_tokens_for(model, tokenizer, ids, max_tokens):
    from mlx_lm import stream_generate

    return [(r.token, r.logprobs[r.token].item())
            for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]
