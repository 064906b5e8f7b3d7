"""Rebuild a Hugging Face `tokenizers` tokenizer from GGUF metadata.

Supports GGUF's "gpt2" tokenizer model: a byte-level BPE whose vocabulary and
merges are stored as-is. The pre-tokenizer is chosen from `tokenizer.ggml.pre`.
"""

import logging

log = logging.getLogger(__name__)

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEX = {"llama-bpe": LLAMA3_REGEX, "llama3": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}
GPT2_STYLE = {"default", "gpt2", "smollm", "starcoder", "refact", "codeshell"}
DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell"}   # every digit on its own

# GGUF token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class TokenizerError(ValueError):
    pass


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in SPLIT_REGEX:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in GPT2_STYLE:
        log.warning("unknown GGUF pre-tokenizer %r; using GPT-2's", pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return byte_level


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` equivalent to the GGUF's embedded one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', "
                             "the byte-level BPE of Llama 3, Qwen, SmolLM and others)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = _token_types(meta, len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=meta.get("tokenizer.ggml.pre") == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == CONTROL])
    bos = special_token(meta, "bos")
    if bos is not None and _flag(meta, "tokenizer.ggml.add_bos_token"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    return tok


def tokenizer_config(meta: dict) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "add_bos_token": _flag(meta, "tokenizer.ggml.add_bos_token"),
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
    """GGUF scalars arrive as 0-d mx.arrays; plain Python values pass through."""
    return value.item() if hasattr(value, "item") else value


def _flag(meta: dict, key: str) -> bool:
    return bool(scalar(meta.get(key, False)))


def _token_types(meta: dict, n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n
    return types.tolist() if hasattr(types, "tolist") else list(types)
