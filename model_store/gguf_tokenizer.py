"""The Hugging Face tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes.

transformers' `convert_gguf_tokenizer` builds it (byte-level BPE for GGUF's "gpt2"
model; SentencePiece-style BPE for "llama", with Gemma's and Phi-3's variants; unigram
for "t5") from the metadata as our `gguf` reader gives it; its own reader needs torch.
Set here on top: the individual-digit split of SmolLM/StarCoder-style "gpt2"
vocabularies and Llama 3's whole-word lookup (`ignore_merges`), which that converter
leaves out; the BOS the file asks for; and no token beyond the file's vocabulary (the
converter's GPT-2 class adds "<|endoftext|>" when the vocabulary lacks it).
"""

DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell"}   # every digit on its own


class TokenizerError(ValueError):
    pass


def tokenizer_dict(meta: dict) -> dict:
    """The metadata under transformers' names (`tokens`, `merges`, `token_type`, ...)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    out = {}
    for key, name in renames.items():
        value = meta.get(f"tokenizer.{key}")
        if value is not None:
            out[name] = value.tolist() if hasattr(value, "tolist") else value
    return out


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` equivalent to the GGUF's embedded one."""
    from tokenizers import pre_tokenizers, processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError("the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
    try:
        tok, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict(meta))
    except ValueError as exc:   # an unknown tokenizer.ggml.model
        raise TokenizerError(str(exc)) from None
    tok = _without_foreign_tokens(tok, len(meta["tokenizer.ggml.tokens"]))
    pre = meta.get("tokenizer.ggml.pre")
    if meta.get("tokenizer.ggml.model") == "gpt2" and pre in DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "llama-bpe":   # Llama 3 looks a whole word up before merging
        tok.model.ignore_merges = True
    bos = special_token(meta, "bos")
    if bos is not None and add_bos(meta):
        bos_id = scalar(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tok


def _without_foreign_tokens(tok, n_tokens: int):
    """The tokenizer less the tokens its transformers class adds by default where the
    vocabulary lacks them (GPT-2's "<|endoftext|>"): ids the model has no row for."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < n_tokens]
    if spec["model"].get("unk_token") not in spec["model"]["vocab"]:
        spec["model"]["unk_token"] = None
    return Tokenizer.from_str(json.dumps(spec))


def add_bos(meta: dict) -> bool:
    """llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(scalar(meta.get("tokenizer.ggml.add_bos_token", default)))


def tokenizer_config(meta: dict) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos(meta),
              "clean_up_tokenization_spaces": False}
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                      ("padding", "pad_token")):
        token = special_token(meta, name)
        if token is not None:
            config[key] = token
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def special_token(meta: dict, name: str) -> str | None:
    token_id = scalar(meta.get(f"tokenizer.ggml.{name}_token_id"))
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and token_id < len(tokens) else None


def scalar(value):
    """GGUF scalars may arrive as numpy values; plain Python values pass through."""
    return value.item() if hasattr(value, "item") else value
