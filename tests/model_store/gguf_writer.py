"""Test GGUF files written with the `gguf` package, llama.cpp's own writer.

`encode` gives a tensor's GGML blocks and the values `gguf.quants.dequantize`
(the reference dequantizer) decodes them to: what a correct reader must serve.
Types `gguf.quants` can quantize are quantized by it; the others (the K-quants,
IQ4_NL, IQ4_XS) are packed here per ggml's block layout.
"""

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.float32)
PLAIN = {"F32": np.float32, "F16": np.float16}


def _f16(x) -> np.ndarray:
    """fp16 as stored, and its float32 value."""
    h = np.asarray(x, np.float32).astype(np.float16)
    return h.view(np.uint8).reshape(len(h), -1), h.astype(np.float32)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _scales(sub: np.ndarray, levels: int, with_min: bool, scale_levels: int):
    """Super-block scales (d, dmin) and per-sub-block integer (sc, m), then the codes:
    x ~ d*sc*q - dmin*m (with_min) or d*sc*q, q in [0, levels] / centred."""
    if with_min:
        lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
        scale, mn = (hi - lo) / levels, -lo
    else:
        scale, mn = np.abs(sub).max(-1) / levels, np.zeros(sub.shape[:2], np.float32)
    d_raw, d = _f16(scale.max(-1) / scale_levels)
    m_raw, dmin = _f16(mn.max(-1) / scale_levels)
    sc = np.clip(np.round(_div(scale, d[:, None])), 0, scale_levels)
    m = np.clip(np.round(_div(mn, dmin[:, None])), 0, scale_levels)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * m)[..., None]
    return d_raw, m_raw, sc.astype(np.uint8), m.astype(np.uint8), step, offset


def _codes(sub, step, offset, lo, hi):
    return np.clip(np.round(_div(sub + offset, step)), lo, hi).astype(np.uint8)


def _nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo | (hi << 4)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (inverse of get_scale_min)."""
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=-1)


def _q4_k(x):
    sub = x.reshape(-1, 8, 32)
    d, dmin, sc, m, step, offset = _scales(sub, 15, True, 63)
    q = _codes(sub, step, offset, 0, 15).reshape(-1, 4, 2, 32)
    qs = _nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    return np.concatenate([d, dmin, _k_scales(sc, m), qs], axis=-1)


def _q5_k(x):
    sub = x.reshape(-1, 8, 32)
    d, dmin, sc, m, step, offset = _scales(sub, 31, True, 63)
    q = _codes(sub, step, offset, 0, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = _nibbles(low[:, :, 0], low[:, :, 1]).reshape(-1, 128)
    return np.concatenate([d, dmin, _k_scales(sc, m), qh, qs], axis=-1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit codes of 256 elements in Q2_K/Q3_K's order: (half, shift, 32) -> bytes."""
    q = q.reshape(-1, 2, 4, 32)
    return (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2) \
        .astype(np.uint8).reshape(-1, 64)


def _q2_k(x):
    sub = x.reshape(-1, 16, 16)
    d, dmin, sc, m, step, offset = _scales(sub, 3, True, 15)
    q = _codes(sub, step, offset, 0, 3)
    return np.concatenate([sc | (m << 4), _crumbs(q), d, dmin], axis=-1)


def _signed_scales(sub, levels, scale_bits):
    """d (fp16) and signed per-sub-block sc with x ~ d*sc*q, |q| <= levels."""
    scale = np.abs(sub).max(-1) / levels
    top = 2 ** (scale_bits - 1) - 1
    d_raw, d = _f16(scale.max(-1) / top)
    sc = np.clip(np.round(_div(scale, d[:, None])), -top - 1, top)
    return d_raw, sc.astype(np.int32), (d[:, None] * sc)[..., None]


def _q3_k(x):
    sub = x.reshape(-1, 16, 16)
    d, sc, step = _signed_scales(sub, 4, 6)
    q = np.clip(np.round(_div(sub, step)), -4, 3).astype(np.int32).reshape(-1, 256)
    hmask = ((q >= 0).astype(np.uint8).reshape(-1, 8, 32)
             << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    s = (sc + 32).astype(np.uint8)
    scales = np.concatenate([(s[:, :8] & 0xF) | ((s[:, 8:] & 0xF) << 4),
                             ((s >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))
                              [None, :, None]).sum(1).astype(np.uint8)], axis=-1)
    return np.concatenate([hmask, _crumbs(((q + 4) & 3).astype(np.uint8)), scales, d], axis=-1)


def _q6_k(x):
    sub = x.reshape(-1, 16, 16)
    d, sc, step = _signed_scales(sub, 32, 8)
    q = (np.clip(np.round(_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = q & 0xF, q >> 4
    ql = _nibbles(low[:, :, :2], low[:, :, 2:]).reshape(-1, 128)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2) \
        .astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d], axis=-1)


def _iq4_codes(sub, step):
    return np.abs(_div(sub, step)[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def _iq4_nl(x):
    sub = x.reshape(-1, 1, 32)
    d, d32 = _f16(np.abs(sub).max(-1).ravel() / 127)
    q = _iq4_codes(sub, d32[:, None, None]).reshape(-1, 32)
    return np.concatenate([d, _nibbles(q[:, :16], q[:, 16:])], axis=-1)


def _iq4_xs(x):
    sub = x.reshape(-1, 8, 32)
    d, sc, step = _signed_scales(sub, 127, 6)
    q = _iq4_codes(sub, step)
    ls = (sc + 32).astype(np.uint8)
    high = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1)
    low = _nibbles(ls[:, 0::2] & 0xF, ls[:, 1::2] & 0xF)
    qs = _nibbles(q[..., :16], q[..., 16:]).reshape(-1, 128)
    return np.concatenate([d, high.astype(np.uint16).view(np.uint8).reshape(-1, 2), low, qs],
                          axis=-1)


# ggml's block layouts for the types gguf.quants cannot quantize (simple rounding,
# not llama.cpp's search: any valid blocks do, the reference decodes them)
PACKERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
           "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def random_blocks(shape, kind: str, rng) -> np.ndarray:
    """Random bytes as blocks of `kind` (for a type nothing here can decode)."""
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


def encode(x: np.ndarray, kind: str, rng) -> tuple[np.ndarray, np.ndarray | None]:
    """(the tensor as written: a float array or GGML blocks as uint8 rows,
    the float32 values gguf's reference dequantizer reads from it)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if kind in PLAIN:
        raw = x.astype(PLAIN[kind])
        return raw, raw.astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    if kind in PACKERS:
        raw = PACKERS[kind](x.reshape(-1, 256 if kind != "IQ4_NL" else 32))
        raw = raw.reshape(*x.shape[:-1], -1)
    elif kind == "Q8_1":
        return random_blocks(x.shape, kind, rng), None
    else:
        raw = quants.quantize(x, qtype)
    return raw, quants.dequantize(raw, qtype)


def write_gguf(path, tensors: dict, metadata: dict, seed: int = 0) -> dict:
    """`tensors`: name -> (array, kind); `metadata` holds general.architecture.
    Returns name -> the values gguf's reference dequantizer decodes."""
    rng = np.random.default_rng(seed)
    meta = dict(metadata)
    writer = GGUFWriter(str(path), meta.pop("general.architecture"))
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    decoded = {}
    for name, (array, kind) in tensors.items():
        raw, decoded[name] = encode(array, kind, rng)
        qtype = None if kind in PLAIN else GGMLQuantizationType[kind]
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


# --- whole models, written as llama.cpp's convert_hf_to_gguf.py writes them ---

# mlx_lm model_type -> GGUF general.architecture (Mistral's files say "llama")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "phi3": "phi3"}
GEMMA = {"gemma2", "gemma3"}


def llama_permute(x: np.ndarray, n_heads: int) -> np.ndarray:
    """The exporter's Q/K row order for llama: per head, rows (2, half) -> (half, 2)."""
    return (x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def llama_unpermute(x: np.ndarray, n_heads: int) -> np.ndarray:
    return (x.reshape(n_heads, x.shape[0] // n_heads // 2, 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def model_metadata(config: dict, arch: str) -> dict:
    """The hyperparameters the exporter writes for `config` (an mlx_lm config.json)."""
    keys = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
            "attention.key_length": "head_dim", "attention.value_length": "head_dim",
            "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
            "attn_logit_softcapping": "attn_logit_softcapping",
            "final_logit_softcapping": "final_logit_softcapping",
            "attention.sliding_window": "sliding_window"}
    meta = {"general.architecture": arch}
    meta.update({f"{arch}.{key}": config[name] for key, name in keys.items() if name in config})
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        meta.update({f"{arch}.rope.scaling.type": "linear",
                     f"{arch}.rope.scaling.factor": float(scaling["factor"])})
    if arch == "phi3":
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        meta["phi3.rope.dimension_count"] = int(head_dim * config.get("partial_rotary_factor", 1))
    return meta


def export_tensors(weights: dict, config: dict, arch: str,
                   permute: bool = True) -> tuple[dict, dict]:
    """(GGUF name -> array as the exporter stores it, GGUF name -> HF name). Names come
    from gguf-py's own TensorNameMap; llama's Q/K rows are permuted (unless not
    `permute`: a file as a broken exporter would write it), Gemma's norms stored as
    1 + w, and a tied model has no output.weight."""
    import gguf

    arch_enum = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors, hf_names = {}, {}
    for hf, value in weights.items():
        if hf == "lm_head.weight" and config.get("tie_word_embeddings", arch in GEMMA):
            continue
        name = names.get_name(hf.replace(".switch_mlp.", ".experts."),
                              try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        role = name.split(".")[2] if name.startswith("blk.") else None
        if arch == "llama" and role in heads and permute:
            value = llama_permute(value, heads[role])
        if arch in GEMMA and hf.endswith("norm.weight"):
            value = value + np.float32(1)
        tensors[name], hf_names[name] = value, hf
    return tensors, hf_names


def write_model(folder, path, kind, tokenizer_meta: dict, seed: int = 0,
                permute: bool = True) -> dict:
    """Write the mlx_lm model in `folder` to the GGUF `path` as llama.cpp's exporter
    would: matrices (and stacked experts) in `kind` (a type, or GGUF name -> type),
    vectors in F32. Returns the HF-named values a correct converter serves: gguf's
    reference dequantizer's, with the exporter's transforms undone."""
    import json
    from pathlib import Path

    import mlx.core as mx

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    weights = {k: np.array(v.astype(mx.float32))
               for k, v in mx.load(str(folder / "model.safetensors")).items()}
    tensors, hf_names = export_tensors(weights, config, arch, permute)
    kind_of = kind if callable(kind) else lambda name: kind
    typed = {name: (value, kind_of(name) if value.ndim >= 2 else "F32")
             for name, value in tensors.items()}
    decoded = write_gguf(path, typed, {**model_metadata(config, arch), **tokenizer_meta}, seed)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    expected = {}
    for name, value in decoded.items():
        role = name.split(".")[2] if name.startswith("blk.") else None
        if arch == "llama" and role in heads and permute:
            value = llama_unpermute(value, heads[role])
        if arch in GEMMA and name.endswith("norm.weight"):
            value = value - np.float32(1)
        expected[hf_names[name]] = value
    return expected


def _tokenizer_files(folder):
    """A folder's tokenizer.json and tokenizer_config.json, its vocabulary, its
    tokens in id order and its special tokens' texts."""
    import json
    from pathlib import Path

    folder = Path(folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    return tok, tok_config, vocab, sorted(vocab, key=vocab.get), special


def bpe_tokenizer_metadata(folder) -> dict:
    """GGUF's "gpt2" tokenizer for a folder's byte-level BPE tokenizer.json."""
    tok, tok_config, vocab, tokens, special = _tokenizer_files(folder)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": vocab[tok_config["bos_token"]],
        "tokenizer.ggml.eos_token_id": vocab[tok_config["eos_token"]],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": tok_config["chat_template"],
    }


def sentencepiece_tokenizer_metadata(folder, merges: bool = True) -> dict:
    """GGUF's "llama" (SentencePiece) tokenizer for a folder's tokenizer.json of that
    shape, as the exporter writes it: pieces in id order, a score per piece (its rank:
    earlier is better), token types (UNKNOWN, CONTROL, BYTE for <0xXX>, NORMAL), and,
    if `merges`, the BPE merges (without them a reader derives merges from the scores)."""
    import re

    tok, tok_config, vocab, tokens, special = _tokenizer_files(folder)

    def token_type(t):
        if t == tok_config["unk_token"]:
            return 2
        return 3 if t in special else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 1

    meta = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
        "tokenizer.ggml.token_type": [token_type(t) for t in tokens],
        "tokenizer.ggml.bos_token_id": vocab[tok_config["bos_token"]],
        "tokenizer.ggml.eos_token_id": vocab[tok_config["eos_token"]],
        "tokenizer.ggml.unknown_token_id": vocab[tok_config["unk_token"]],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": tok_config["chat_template"],
    }
    if merges:
        meta["tokenizer.ggml.merges"] = [m if isinstance(m, str) else " ".join(m)
                                         for m in tok["model"]["merges"]]
    return meta


def assert_same_tokenization(original, rebuilt, texts) -> None:
    """`rebuilt` (a tokenizer converted from GGUF) encodes and decodes `texts` as
    `original` does, special tokens kept and skipped, and has as many tokens."""
    for text in texts:
        ids = original.encode(text)
        assert rebuilt.encode(text) == ids, text
        assert rebuilt.decode(ids) == original.decode(ids)
        assert rebuilt.decode(ids, skip_special_tokens=True) == \
            original.decode(ids, skip_special_tokens=True)
    assert len(rebuilt) == len(original)
