"""K-quant GGUF files on this machine: decode speed and weight memory of each form
the conversion offers, for a Q4_K and a Q6_K file of the same model.

    python -m bench.gguf_forms                    # the ~40M bench model (hidden 512)
    python -m bench.gguf_forms --model smollm2    # the server's default model

The model's float32 weights are written as a GGUF the way llama.cpp's exporter does
(tests/model_store/gguf_writer.py packs the blocks): every matrix in the type, except
those whose rows are not a multiple of 256 (a K-quant super-block), which llama.cpp
writes in its fallback type (Q4_K: Q5_0; Q6_K: Q8_0); SmolLM2's hidden size is 576,
so in its files only the feed-forward down projections are K-quants. Each file is then
converted (model_store/gguf.py) and loaded as the worker loads it:

- Q4_K: kept in its exact MLX form (4-bit groups of 32; `--dequantize off`), against
  the same folder dequantized to float32 at load (what `--dequantize auto` chooses on
  the CPU backend when float32 fits the memory limit);
- Q6_K: no exact MLX form, so float32 (the conversion's default; its fallback
  tensors, exact 8-bit, dequantized at load too, as `auto` does on the CPU) against
  8-bit re-quantized (`--inexact q8`) and kept quantized.

Runs in one process with the worker's BLAS (re-executed with LD_PRELOAD on Linux);
the variants alternate per repeat, and the ratio of medians is printed.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, bench_model, random_prompts, rerun_with_worker_blas, tokenizer_vocab
from bench.dequantize import measure

FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}   # llama.cpp's, for rows not of 256


def float_folder(path: str, out: Path) -> Path:
    """The model at `path` with float32 weights (dequantized if it is quantized)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxd.worker_proc.loading import load_model

    model, _ = load_model(path, dequantize=True)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = json.loads((Path(path) / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))
    for name in os.listdir(path):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            (out / name).write_bytes((Path(path) / name).read_bytes())
    return out


def write_file(folder: Path, kind: str, gguf_path: Path) -> dict:
    """Write the K-quant GGUF; the count of tensors per type in it."""
    sys.path.insert(0, str(ROOT / "tests" / "model_store"))
    from gguf_writer import bpe_tokenizer_metadata, write_model

    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    row = {"ffn_down": inner}   # every other matrix's rows are the hidden size long
    written: dict[str, int] = {}

    def kind_of(name: str) -> str:
        role = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        chosen = kind if row.get(role, hidden) % 256 == 0 else FALLBACK[kind]
        written[chosen] = written.get(chosen, 0) + 1
        return chosen

    write_model(folder, gguf_path, kind_of, bpe_tokenizer_metadata(folder))
    return written


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder, or smollm2")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rerun_with_worker_blas(__spec__.name)
    from mlxd.model_store.gguf import convert
    from mlxd.worker_proc.loading import load_model

    path = bench_model(args.model)
    prompt = random_prompts(1, args.prompt_len, tokenizer_vocab(path))[0]
    with tempfile.TemporaryDirectory(prefix="mlxd-gguf-forms-") as tmp:
        work = Path(tmp)
        folder = float_folder(path, work / "float32")
        variants = {}
        for kind, forms in (("Q4_K", (("quantized", "float32", False), ("float32", "float32", True))),
                            ("Q6_K", (("float32", "float32", True), ("q8", "q8", False)))):
            gguf_path = work / f"{kind}.gguf"
            written = write_file(folder, kind, gguf_path)
            print(f"{kind} file: {gguf_path.stat().st_size / 2**20:.1f} MiB, matrices {written}")
            for name, inexact, dequantize in forms:
                converted = convert(gguf_path, work / f"{kind}-{inexact}", inexact=inexact)
                variants[(kind, name)] = load_model(str(converted), dequantize=dequantize)
        rates = {key: [] for key in variants}
        for model, tok in variants.values():   # warm up
            measure(model, tok, prompt[:16], 4)
        for _ in range(args.repeats):
            for key, (model, tok) in variants.items():
                rates[key].append(measure(model, tok, prompt, args.gen_len)[1])
    print(f"{path}: prompt {args.prompt_len}, output {args.gen_len}, {args.repeats} repeats, "
          f"BLAS {os.environ.get('LD_PRELOAD') or 'bundled'}")
    median = {key: statistics.median(r) for key, r in rates.items()}
    for (kind, name), (model, _) in variants.items():
        print(f"  {kind} {name:9s} decode {median[(kind, name)]:6.1f} tok/s "
              f"(runs {', '.join(f'{r:.1f}' for r in rates[(kind, name)])})   "
              f"weights {weight_bytes(model) / 2**20:7.1f} MiB")
    for kind, (a, b) in (("Q4_K", ("float32", "quantized")), ("Q6_K", ("float32", "q8"))):
        print(f"  {kind}: {a}/{b} decode {median[(kind, a)] / median[(kind, b)]:.2f}x")


if __name__ == "__main__":
    main()
