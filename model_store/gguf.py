"""Convert a llama-family GGUF file into an mlx_lm model folder.

    python -m mlxd.model_store.gguf [--inexact q8] FILE.gguf OUT_DIR

The `gguf` package (llama.cpp's own reader) reads the file; `mx.load` is not used:
it mis-decodes Q4_K and silently drops tensors of types it does not know. Each
tensor is kept in its exact MLX form where there is one (gguf_quants.py), so the
folder stays near the GGUF's size (float32 scales and biases add 2 bits a weight;
Q2_K/Q3_K/Q6_K tensors are float32 unless `--inexact q8`); the worker may
dequantize at load time. The
form chosen per GGML type is recorded in config.json ("gguf"). Q and K projections
are permuted back from GGUF's rotary row order to the Hugging Face layout mlx_lm
expects.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .gguf_quants import INEXACT_FORMS, QuantError, to_mlx
from .gguf_tokenizer import build_tokenizer, scalar, special_token, tokenizer_config

SUPPORTED_ARCHITECTURES = ("llama",)
# Bumped whenever a conversion's output changes, so an older cached folder is not used.
CONVERSION_VERSION = 2

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


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


def hf_config(meta: dict, weights: dict, modules: dict | None = None) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; "
                        f"supported: {SUPPORTED_ARCHITECTURES}")
    if "rope_freqs.weight" in weights:
        raise GGUFError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported")

    def get(key, default=None):
        value = scalar(meta.get(f"{arch}.{key}", default))
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for name in ("bos", "eos"):
        token_id = scalar(meta.get(f"tokenizer.ggml.{name}_token_id"))
        if token_id is not None:
            config[f"{name}_token_id"] = token_id
    quantization = quantization_config(modules or {})
    if quantization:
        config["quantization"] = quantization
    return config


def _hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")   # kind: weight, scales or biases
    if stem in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    raise GGUFError(f"unexpected tensor {name!r} in a llama GGUF")


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


def hf_weights(weights: dict, config: dict) -> dict:
    """Rename to mlx_lm's llama names and restore the Q/K row order. Quantized
    rows are independent, so weight, scales and biases permute alike."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for name, value in weights.items():
        role = name.split(".")[2] if name.startswith("blk.") else None
        if role in heads:
            value = unpermute_rows(value, heads[role])
        out[_hf_name(name)] = value
    return out


def quantization_config(modules: dict) -> dict | None:
    """mlx_lm's "quantization" entry (GGUF stem -> the module's quantization): the
    most common one, and a per-module entry for each module that differs."""
    if not modules:
        return None
    kinds = [json.dumps(q, sort_keys=True) for q in modules.values()]
    config = json.loads(max(set(kinds), key=kinds.count))
    config.update({_hf_name(f"{stem}.weight").removesuffix(".weight"): q
                   for stem, q in sorted(modules.items()) if q != config})
    return config


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
            inexact: str = INEXACT_FORMS[0]) -> Path:
    """Write the model folder for `gguf_path` to `out_dir` (atomically). `inexact`:
    the form of types with no exact MLX one (float32, or q8: 8-bit re-quantized)."""
    if inexact not in INEXACT_FORMS:
        raise GGUFError(f"inexact must be one of {INEXACT_FORMS}, not {inexact!r}")
    tensors, meta = read_gguf(gguf_path)
    hf_config(meta, tensors)   # refuse an unsupported model before decoding anything
    weights, modules, forms = mlx_tensors(tensors, inexact)
    config = hf_config(meta, weights, modules)
    config["gguf"] = {"conversion_version": CONVERSION_VERSION, "inexact": inexact,
                      "forms": dict(sorted(forms.items()))}
    tokenizer = build_tokenizer(meta)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_folder(out.parent)
    try:
        _write_folder(tmp, hf_weights(weights, config), config, tokenizer, meta)
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
    ap = argparse.ArgumentParser(description="Convert a llama-family GGUF file into an "
                                             "mlx_lm model folder.")
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
