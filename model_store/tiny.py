"""Build small random-weight mlx_lm model folders with a freshly trained BPE tokenizer.

Used for the built-in demo model (so a fresh machine serves something with no
downloads) and by the tests. The folder is an ordinary mlx_lm model folder:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
"""

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS = "<s>", "</s>"

_WORDS = (
    "the a an of to and in is was it for on with as by at from this that be are or not "
    "have has had but what all were when we there can been one will would each which "
    "their said if do into time about many then them these so some her make like him "
    "see could has two more write go number no way people my than first water been "
    "call who oil its now find long down day did get come made may part over new sound "
    "take only little work know place year live me back give most very after thing our "
    "just name good sentence man think say great where help through much before line "
    "right too mean old any same tell boy follow came want show also around form three "
    "small set put end does another well large must big even such because turn here why "
    "ask went men read need land different home us move try kind hand picture again "
    "change off play spell air away animal house point page letter mother answer found "
    "study still learn should America world capital France Paris city river mountain "
    "hello model server token cache batch decode prefill question answer quick brown fox"
).split()


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"            # "llama" or "qwen3"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0


def training_corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = rng.choices(_WORDS, k=rng.randint(4, 16))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        lines.append(line)
    lines += ["Ünïcödé ½ € 日本語 😀 naïve café", "0123456789 + - * / = ( ) [ ] { }"]
    return lines


def train_tokenizer(vocab_size: int, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def model_config(spec: TinySpec, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    head_dim = spec.hidden_size // spec.num_heads
    config = {
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if spec.arch == "qwen3":
        config["architectures"] = ["Qwen3ForCausalLM"]
    else:
        config["architectures"] = ["LlamaForCausalLM"]
    return config


def _save_weights(config: dict, spec: TinySpec, path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    mx.random.seed(spec.seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Larger-than-default init spreads the logits, so greedy decoding does not
    # collapse into one repeated token and logprob comparisons are meaningful.
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            params[name] = mx.random.normal(value.shape) * 1.0
    mx.save_safetensors(str(path / "model.safetensors"), params)


def build_tiny_model(out_dir: str | os.PathLike, spec: TinySpec = TinySpec(),
                     corpus: list[str] | None = None) -> Path:
    """Write a complete model folder to `out_dir` (atomically) and return its path."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=out.parent))
    tok = train_tokenizer(spec.vocab_size, corpus or training_corpus(seed=spec.seed))
    tok.save(str(tmp / "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    # The model's vocabulary may be larger than the trained tokenizer's, as in real models.
    config = model_config(spec, max(spec.vocab_size, tok.get_vocab_size()), bos_id, eos_id)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": "<pad>",
        "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings,
    }, indent=2))
    _save_weights(config, spec, tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race; use its folder
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


DEMO_SPEC = TinySpec(arch="llama", hidden_size=256, num_layers=4, num_heads=4,
                     num_kv_heads=2, intermediate_size=512, vocab_size=2048, seed=1234)


def demo_model_path(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / "demo-llama-h256-l4-v1"


def default_cache_dir() -> Path:
    root = os.environ.get("MLXD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxd")
    return Path(root)
