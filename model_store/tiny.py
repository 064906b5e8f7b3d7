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
    arch: str = "llama"            # an mlx_lm model_type ("llama", "qwen3", "gemma3_text", ...)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0
    extra: tuple = ()              # (key, value) pairs added to config.json (HYBRID_EXTRA's)
    weight_scale: float = 1.0      # the layers' random matrices scaled by this


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
    elif spec.arch == "llama":
        config["architectures"] = ["LlamaForCausalLM"]
    config.update(dict(spec.extra))
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
        elif value.ndim >= 2 and spec.weight_scale != 1.0:
            params[name] = value * spec.weight_scale
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


# Per architecture, what mlx_lm's ModelArgs needs beyond model_config's common fields, at
# tiny sizes (hidden 64..128, 2..4 layers): sliding-window and recurrent-state models.
HYBRID_EXTRA: dict[str, tuple] = {
    "gemma3_text": (("sliding_window", 8), ("sliding_window_pattern", 2),
                    ("query_pre_attn_scalar", 32), ("rope_local_base_freq", 10000.0)),
    "gpt_oss": (("sliding_window", 8), ("num_local_experts", 4), ("num_experts_per_tok", 2),
                ("layer_types", ["sliding_attention", "full_attention"])),
    "cohere2": (("sliding_window", 8), ("sliding_window_pattern", 2), ("logit_scale", 1.0),
                ("layer_norm_eps", 1e-5)),
    "qwen3_next": (("linear_num_value_heads", 4), ("linear_num_key_heads", 2),
                   ("linear_key_head_dim", 16), ("linear_value_head_dim", 16),
                   ("linear_conv_kernel_dim", 4), ("num_experts", 4),
                   ("num_experts_per_tok", 2), ("decoder_sparse_step", 1),
                   ("shared_expert_intermediate_size", 64), ("mlp_only_layers", []),
                   ("moe_intermediate_size", 64), ("partial_rotary_factor", 0.25),
                   ("full_attention_interval", 2)),
    "lfm2": (("norm_eps", 1e-5), ("conv_bias", False), ("conv_L_cache", 3),
             ("block_dim", 128), ("block_multiple_of", 32),
             ("block_ffn_dim_multiplier", 1.0), ("block_auto_adjust_ff_dim", False),
             ("block_ff_dim", 256), ("full_attn_idxs", [1])),
    "mamba2": (("num_heads", 8), ("head_dim", 32), ("state_size", 16),
               ("layer_norm_epsilon", 1e-5), ("conv_kernel", 4), ("n_groups", 1),
               ("use_bias", False), ("use_conv_bias", True), ("time_step_limit", [0.0, 1e9]),
               ("time_step_rank", "auto"), ("intermediate_size", 256)),
    "granitemoehybrid": (("attention_bias", False), ("embedding_multiplier", 1.0),
                         ("attention_multiplier", 0.125), ("logits_scaling", 1.0),
                         ("residual_multiplier", 1.0), ("layer_types", ["mamba", "attention"]),
                         ("mamba_n_heads", 8), ("mamba_d_head", 32), ("mamba_proj_bias", False),
                         ("mamba_d_state", 16), ("mamba_d_conv", 4), ("mamba_n_groups", 1),
                         ("mamba_conv_bias", True), ("shared_intermediate_size", 256),
                         ("position_embedding_type", "rope")),
    "falcon_h1": (("mamba_d_ssm", 128), ("mamba_n_heads", 4), ("mamba_d_head", 32),
                  ("mamba_d_state", 16), ("mamba_d_conv", 4), ("mamba_chunk_size", 16)),
}


# With their tied embeddings and default-sized layers, these tiny models' residual
# stream stays close to the input embedding and greedy decoding repeats one token
# whatever the prompt (which would hide a broken state); larger layers fix that.
HYBRID_WEIGHT_SCALE = {"lfm2": 10.0, "cohere2": 10.0}


def hybrid_spec(arch: str, seed: int = 0, **overrides) -> TinySpec:
    """A tiny spec of `arch` (a key of HYBRID_EXTRA), 2 layers, hidden 128."""
    extra = dict(HYBRID_EXTRA[arch])
    extra.update(overrides)
    return TinySpec(arch=arch, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, vocab_size=512, seed=seed,
                    extra=tuple(extra.items()),
                    weight_scale=HYBRID_WEIGHT_SCALE.get(arch, 1.0))
