"""The model's tokenizer and chat template, loaded with transformers (no MLX here)."""

import json
from pathlib import Path

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


class TextCodec:
    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = sorted(_config_eos_ids(self.path) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()))
        # Token ids the model accepts: its embedding may be larger than the tokenizer.
        self.vocab_size = max(len(self.tokenizer), _config_vocab_size(self.path))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str) -> list[int]:
        # Like mlx_lm: add BOS unless the text already starts with it.
        bos = self.tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a prompt instead")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises its own exception types
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
