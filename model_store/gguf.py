"""Convert a GGUF file (llama, mistral, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3)
into an mlx_lm model folder.

    python -m mlxd.model_store.gguf [--inexact q8] FILE.gguf OUT_DIR

The `gguf` package (llama.cpp's own reader) reads the file; `mx.load` is not used:
it mis-decodes Q4_K and silently drops tensors of types it does not know. Each
tensor is kept in its exact MLX form where there is one (gguf_quants.py), so the
folder stays near the GGUF's size (float32 scales and biases add 2 bits a weight;
Q2_K/Q3_K/Q6_K tensors are float32 unless `--inexact q8`); the worker may
dequantize at load time. The form chosen per GGML type is recorded in config.json
("gguf"). What llama.cpp's exporter did to a family's tensors is undone (Family):
llama's Q/K rows permuted back from GGUF's rotary order, Gemma's norms stored as 1 + w.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .gguf_quants import INEXACT_FORMS, QuantError, to_mlx
from .gguf_tokenizer import (TokenizerError, build_tokenizer, scalar, special_token,
                             tokenizer_config)

# Bumped whenever a conversion's output changes, so an older cached folder is not used.
CONVERSION_VERSION = 2

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
# GGUF's per-layer tensor names (gguf-py's constants) -> mlx_lm's, for the llama layout;
# a family's `names` override these.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
             "ffn_up_exps": "mlp.switch_mlp.up_proj",
             "ffn_down_exps": "mlp.switch_mlp.down_proj"}
PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto an mlx_lm model: the model_type, tensor
    names, and what llama.cpp's exporter did to the tensors that must be undone."""

    model_type: str
    names: dict = field(default_factory=dict)
    permute_qk: bool = False      # Q/K rows stored in GGUF's rotary order (llama only)
    norm_offset: float = 0.0      # stored norm weights are w + offset (Gemma's 1 + w)
    extra: Callable[[Callable], dict] = lambda get: {}   # config keys from metadata


def _qwen3moe_extra(get) -> dict:
    return {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def _gemma_scale(get, big_model_layers: int) -> float:
    """llama.cpp's attention scale: 1/sqrt(head_dim), but hidden/heads for the 27B."""
    if get("block_count") == big_model_layers:
        return get("embedding_length") / get("attention.head_count")
    return get("attention.key_length")


def _gemma2_extra(get) -> dict:
    return {"query_pre_attn_scalar": _gemma_scale(get, 46),
            "attn_logit_softcapping": get("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": get("final_logit_softcapping", 30.0)}


def _gemma3_extra(get) -> dict:
    # llama.cpp fixes what the file does not state: every 6th layer global, the local
    # layers' rope base 10000
    extra = {"query_pre_attn_scalar": _gemma_scale(get, 62),
             "sliding_window": get("attention.sliding_window"), "sliding_window_pattern": 6,
             "rope_local_base_freq": 10000.0}
    if get("rope.scaling.type", "none") == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return extra


def _phi3_extra(get) -> dict:
    head_dim = get("embedding_length") // get("attention.head_count")
    return {"partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim}


# GGUF general.architecture -> Family. Mistral's files say "llama".
FAMILIES = {
    "llama": Family("llama", permute_qk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen3moe": Family("qwen3_moe", MOE_NAMES, extra=_qwen3moe_extra),
    "gemma2": Family("gemma2", GEMMA_NAMES, norm_offset=1.0, extra=_gemma2_extra),
    "gemma3": Family("gemma3_text", GEMMA_NAMES, norm_offset=1.0, extra=_gemma3_extra),
    "phi3": Family("phi3", PHI3_NAMES, extra=_phi3_extra),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# transformers' names for GGUF architectures, where they differ (its GGUF_CONFIG_MAPPING)
HF_ARCH = {"qwen3moe": "qwen3_moe"}
# tensors of features no mlx_lm model here reads
UNSUPPORTED_TENSORS = {"rope_freqs.weight": "rope_freqs (Llama 3.1 rope scaling)",
                       "rope_factors_long.weight": "rope_factors_long (Phi-3 long rope)"}


class GGUFError(ValueError):
    pass


def read_gguf(path: str | os.PathLike):
    """(the tensors, by name: (data, GGML type, numpy shape), the metadata dict)."""
    from gguf import GGUFReader

    try:   # a bad UTF-8 string and an unknown GGML type are ValueErrors too
        reader = GGUFReader(path)
        meta = {f.name: f.contents() for f in reader.fields.values()
                if not f.name.startswith("GGUF.")}
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise GGUFError(f"cannot read {path}: {exc}") from None
    tensors = {t.name: (t.data, t.tensor_type, tuple(int(n) for n in reversed(t.shape)))
               for t in reader.tensors}
    return tensors, meta


def mlx_tensors(tensors: dict, inexact: str) -> tuple[dict, dict, dict]:
    """GGUF name -> MLX array (quantized ones as name.weight/.scales/.biases), the
    form per quantized module (by GGUF stem), and the record of forms per GGML type."""
    arrays, modules, forms = {}, {}, {}
    for name, (data, qtype, shape) in tensors.items():
        try:
            parts, form = to_mlx(name, data, qtype, shape, inexact)
        except QuantError as exc:
            raise GGUFError(str(exc)) from None
        if form.quantization():   # only matrices are kept quantized: name.weight
            stem = name.removesuffix(".weight")
            arrays.update({f"{stem}.{kind}": value for kind, value in parts.items()})
            modules[stem] = form.quantization()
        else:
            arrays[name] = parts["weight"]
        forms[qtype.name] = form.record()
    return arrays, modules, forms


def family_of(meta: dict) -> tuple[str, Family]:
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; "
                        f"supported: {SUPPORTED_ARCHITECTURES}")
    return arch, FAMILIES[arch]


def hf_config(meta: dict, tensors: dict) -> dict:
    """config.json for the GGUF's metadata and `tensors` (name -> (data, type, shape)).
    The keys transformers' GGUF_CONFIG_MAPPING names come from it; the rest (defaults,
    what llama.cpp fixes per family, the vocabulary from the embedding) are here."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch, family = family_of(meta)
    for name, what in UNSUPPORTED_TENSORS.items():
        if name in tensors:
            raise GGUFError(f"GGUF files with {what} are not supported")
    if "token_embd.weight" not in tensors:
        raise GGUFError("the GGUF file has no token_embd.weight")

    def get(key, default=None):
        value = scalar(meta.get(f"{arch}.{key}", default))
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    renames = GGUF_CONFIG_MAPPING.get(HF_ARCH.get(arch, arch), {})
    config = {name: scalar(meta[f"{arch}.{key}"]) for key, name in renames.items()
              if name and f"{arch}.{key}" in meta}
    config.update({
        "model_type": family.model_type, "hidden_size": hidden,
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "intermediate_size": get("feed_forward_length",
                                 scalar(meta.get(f"{arch}.expert_feed_forward_length"))),
        "vocab_size": tensors["token_embd.weight"][2][0],
        "tie_word_embeddings": "output.weight" not in tensors,
    })
    config.update(family.extra(get))
    for name in ("bos", "eos"):
        token_id = scalar(meta.get(f"tokenizer.ggml.{name}_token_id"))
        if token_id is not None:
            config[f"{name}_token_id"] = token_id
    return config


def _hf_name(name: str, family: Family) -> str:
    stem, _, kind = name.rpartition(".")   # kind: weight, bias, scales or biases
    if stem in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    names = {**LAYER_NAMES, **family.names}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    raise GGUFError(f"unexpected tensor {name!r} in a {family.model_type} GGUF")


def unpermute_rows(x, n_heads: int):
    """Undo GGUF's rotary row order: per head, rows (2, half) <- (half, 2)."""
    rows = x.shape[0]
    return (x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def permute_rows(x, n_heads: int):
    """The GGUF writer's row order (the inverse of unpermute_rows)."""
    rows = x.shape[0]
    return (x.reshape(n_heads, 2, rows // n_heads // 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def hf_weights(weights: dict, config: dict, family: Family) -> dict:
    """Rename to mlx_lm's names and undo the exporter's transforms: the Q/K row order
    (quantized rows are independent, so weight, scales and biases permute alike) and
    the norms' offset (norms are vectors, never quantized)."""
    import mlx.core as mx

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for name, value in weights.items():
        stem = name.rpartition(".")[0]
        role = stem.split(".")[2] if name.startswith("blk.") else None
        if family.permute_qk and role in heads:
            value = unpermute_rows(value, heads[role])
        if family.norm_offset and stem.endswith("norm") and name.endswith(".weight"):
            value = value.astype(mx.float32) - family.norm_offset
        out[_hf_name(name, family)] = value
    return out


def quantization_config(modules: dict, family: Family) -> dict | None:
    """mlx_lm's "quantization" entry (GGUF stem -> the module's quantization): the
    most common one, and a per-module entry for each module that differs."""
    if not modules:
        return None
    kinds = [json.dumps(q, sort_keys=True) for q in modules.values()]
    config = json.loads(max(set(kinds), key=kinds.count))
    config.update({_hf_name(f"{stem}.weight", family).removesuffix(".weight"): q
                   for stem, q in sorted(modules.items()) if q != config})
    return config


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
            inexact: str = INEXACT_FORMS[0]) -> Path:
    """Write the model folder for `gguf_path` to `out_dir` (atomically). `inexact`:
    the form of types with no exact MLX one (float32, or q8: 8-bit re-quantized)."""
    if inexact not in INEXACT_FORMS:
        raise GGUFError(f"inexact must be one of {INEXACT_FORMS}, not {inexact!r}")
    tensors, meta = read_gguf(gguf_path)
    _, family = family_of(meta)
    config = hf_config(meta, tensors)   # refuse an unsupported model before decoding anything
    try:
        tokenizer = build_tokenizer(meta)
    except TokenizerError as exc:
        raise GGUFError(str(exc)) from None
    weights, modules, forms = mlx_tensors(tensors, inexact)
    quantization = quantization_config(modules, family)
    if quantization:
        config["quantization"] = quantization
    config["gguf"] = {"conversion_version": CONVERSION_VERSION, "inexact": inexact,
                      "forms": dict(sorted(forms.items()))}
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_folder(out.parent)
    try:
        _write_folder(tmp, hf_weights(weights, config, family), config, tokenizer, meta)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_folder(folder: Path, weights: dict, config: dict, tokenizer, meta: dict) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
    if special_token(meta, "eos") is not None:
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": config["eos_token_id"]}))
    folder.chmod(0o755)


def _temp_folder(parent: Path) -> Path:
    """A new `.converting-<pid>-*` folder in `parent`, renamed into place once
    complete. Those of processes no longer alive (killed midway) are removed first."""
    for stale in parent.glob(".converting-*-*"):
        pid = stale.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".converting-{os.getpid()}-", dir=parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, someone else's
        pass
    return True


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cached_conversion(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike,
                      inexact: str = INEXACT_FORMS[0]) -> Path:
    """The converted folder for this file's content (and this converter's version),
    converting on first use; a folder appears only once complete (convert)."""
    suffix = "" if inexact == INEXACT_FORMS[0] else f"-{inexact}"
    out = (Path(cache_dir) / "gguf" /
           f"{file_sha256(gguf_path)[:32]}-v{CONVERSION_VERSION}{suffix}")
    if not (out / "config.json").exists():
        convert(gguf_path, out, inexact)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Convert a GGUF file into an mlx_lm model "
                                             f"folder ({', '.join(SUPPORTED_ARCHITECTURES)}).")
    ap.add_argument("gguf", help="input .gguf file")
    ap.add_argument("out_dir", help="output folder (replaced if it exists)")
    ap.add_argument("--inexact", choices=INEXACT_FORMS, default=INEXACT_FORMS[0],
                    help="types with no exact MLX form (Q2_K, Q3_K, Q6_K, ...): float32 "
                         "(exact, the default) or q8 (8-bit groups of 32, ~4e-3 error)")
    args = ap.parse_args(argv)
    try:
        out = convert(args.gguf, args.out_dir, args.inexact)
    except (GGUFError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
