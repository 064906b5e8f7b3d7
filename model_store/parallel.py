"""Whether a model folder can be split over a tensor-parallel worker group, checked
before anything starts (the launcher refuses it with the reason)."""

import json
from pathlib import Path


def tensor_parallel_refusal(model_path: str, ranks: int) -> str | None:
    """Why the model cannot be split over `ranks` ranks with mlx_lm's `shard()`;
    None when it can."""
    if ranks == 1:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read ({exc})"
    text = config.get("text_config", config)
    model_type = config.get("model_type", "?")
    if not _has_shard(config):
        return (f"mlx_lm's {model_type} model has no tensor-parallel split (`shard()`); "
                "serve it without --tp")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(n, int) and n % ranks:
            return f"its {n} {what} do not divide over {ranks} ranks (--tp)"
    return None


def _has_shard(config: dict) -> bool:
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError:   # an architecture mlx_lm does not know: the load will say so
        return True
    return hasattr(model_class, "shard")
