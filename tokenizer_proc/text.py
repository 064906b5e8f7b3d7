"""The model's tokenizer and chat template, loaded with transformers (no MLX here)."""

import json
from pathlib import Path
from typing import Callable

from .params import InvalidRequest


def _config_eos_ids(model_path: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_path / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _config_vocab_size(model_path: Path) -> int:
    path = model_path / "config.json"
    if not path.exists():
        return 0
    config = json.loads(path.read_text())
    return int(config.get("text_config", config).get("vocab_size") or 0)


# Normalizers that never make a text shorter in characters than the input, and those
# whose output may be: Unicode composition merges at most 4 code points into one (the
# longest canonical decomposition), so a normalized character stands for <= 4 input ones.
_NON_SHRINKING_NORMALIZERS = {"Prepend", "Append", "Lowercase", "NFD", "NFKD"}
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}
# Pre-tokenizers that keep every character (none removes text).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation",
                           "UnicodeScripts", "Split", "Sequence"}


def _shrink_factor(normalizer: dict | None) -> int | None:
    """How many input characters one normalized character may stand for; None when
    unknown (a normalizer that may drop text)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", []):
            inner_factor = _shrink_factor(inner)
            if inner_factor is None:
                return None
            factor *= inner_factor
        return factor
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "")
        return 1 if pattern is not None and len(content) >= len(pattern) else None
    return _COMPOSING_NORMALIZERS.get(kind)


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def max_chars_per_token(tokenizer) -> int | None:
    """The most input characters one token can stand for, from the vocabulary: a prompt
    longer than max_context times this cannot fit. None where no such bound holds (a
    slow tokenizer, one that fuses unknown characters or whose normalizer may drop
    text), which disables the check."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])):
        return None   # such a token swallows the whitespace next to it, any amount
    if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")):
        return None   # an unknown run may become one token; WordPiece/Unigram unk alike
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    # A token's string spells its text at >= 1 character per input character (byte-level
    # spells a byte per character, byte fallback "<0x41>" one byte in six).
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return longest * factor


class TextCodec:
    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = sorted(_config_eos_ids(self.path) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()))
        # Token ids the model accepts: its embedding may be larger than the tokenizer.
        self.vocab_size = max(len(self.tokenizer), _config_vocab_size(self.path))
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def chat_template_text(self) -> str:
        """The chat template's source (all of them, for tokenizers with several)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else template

    def encode_prompt(self, prompt: str) -> list[int]:
        # Like mlx_lm: add BOS unless the text already starts with it.
        bos = self.tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special)

    def encode_chat(self, messages: list[dict], **template_args) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, **template_args))

    def render_chat(self, messages: list[dict], continue_final: bool = False,
                    **template_args) -> str:
        """The chat template's text for `messages`, with the generation prompt, or,
        with `continue_final`, the last message left open for the reply to continue
        (transformers' continue_final_message); `template_args` (tools,
        enable_thinking, ...) go to the template."""
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a prompt instead",
                                 "messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=not continue_final,
                continue_final_message=continue_final, tokenize=False, **template_args)
        except Exception as exc:  # jinja raises its own exception types
            raise InvalidRequest(f"the chat template rejected the messages: {exc}",
                                 "messages") from None

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat: its special tokens are in the text already."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """`text`'s tokens alone: no special tokens added (no BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_text(self, token: int) -> str:
        """One token as text, special tokens spelled out (for logprobs)."""
        return self.tokenizer.decode([token])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_all(self, token_ids: list[int]) -> str:
        """`decode` with the special tokens' text kept (`skip_special_tokens` false)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def decoder_keeping(self, markers: tuple[str, ...]) -> Callable[[list[int]], str]:
        """`decode`, except that the special tokens spelling one of `markers` (tool-call
        and thinking markup, which some tokenizers make special) stay in the text."""
        keep = {i: t for t in markers if (i := self.special_id(t)) is not None}
        if not keep:
            return self.decode

        def decode(token_ids: list[int]) -> str:
            parts, run = [], []
            for token in token_ids:
                if token in keep:
                    parts += [self.decode(run), keep[token]]
                    run = []
                else:
                    run.append(token)
            return "".join(parts) + self.decode(run)
        return decode

    def special_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, if it is one. A text the
        vocabulary lacks looks up as the unknown token, which may be special
        (SmolLM2's `<|endoftext|>`): only an id that spells `text` back is its token."""
        token = self.tokenizer.convert_tokens_to_ids(text)
        if not isinstance(token, int) or self.tokenizer.convert_ids_to_tokens(token) != text:
            return None
        return token if token in self.tokenizer.all_special_ids or \
            self.decode([token]) != text else None
