"""A draft model for `--speculative draft` made from the model itself: its first N
transformer layers, its embedding, final norm and head (an early-exit draft). It
shares the model's tokenizer, so it is a valid draft for any mlx_lm llama-style
folder; how many of its tokens the full model accepts is what bench/spec.py measures.

    python -m bench.truncated_draft SRC DST --layers 8
    python -m bench.spec --model smollm2 --draft-model DST
"""

import argparse
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncated_copy(src: str | Path, dst: str | Path, layers: int) -> Path:
    """Copy the model folder `src` to `dst` keeping its first `layers` layers."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"{src} has {config['num_hidden_layers']} layers, not {layers}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy2(f, dst / f.name)
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.glob("*.safetensors"):
        weights = mx.load(str(f))
        kept = {k: v for k, v in weights.items()
                if (m := LAYER.search(k)) is None or int(m.group(1)) < layers}
        mx.save_safetensors(str(dst / f.name), kept)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    print(truncated_copy(args.src, args.dst, args.layers))


if __name__ == "__main__":
    main()
